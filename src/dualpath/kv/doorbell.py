"""A node buffer's doorbell: every process that frees slots rings it, and the one process that
waits for slots (the router, or a networked node's side-car) is woken by it at once.

Slots of a node buffer are freed by several processes (the side-car once a block is durable,
a decode instance after its load, a prefill instance's last unpin, the router), each under the
buffer's lock in shared memory, with no message to the process that waits for free slots. The
doorbell is a FIFO beside the buffer's lock file (``mkfifo``; the side-car that creates the
buffer makes and removes it): a ring writes one byte without blocking (nobody listening, or
bytes not read yet: nothing to do, the listener wakes anyway), a listener's descriptor becomes
readable. The kernel carries the wake-up; nothing polls.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading


def make(path: str) -> None:
    """Create the doorbell at ``path`` (a stale file there replaced)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISFIFO(os.stat(path).st_mode):
            return
        os.unlink(path)
    os.mkfifo(path, 0o600)


class Doorbell:
    """The ringing side: one write end kept open per process while someone listens."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._lock = threading.Lock()

    def ring(self) -> None:
        """Wake the listener, if there is one; never blocks, never fails."""
        with self._lock:
            if self._fd < 0:
                try:  # ENXIO: nobody listens; ENOENT: no doorbell (a side-car without one)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    return
            try:
                os.write(self._fd, b"\x01")
            except BlockingIOError:  # unread rings fill the pipe: the listener wakes anyway
                pass
            except OSError as err:  # EPIPE: the listener left; opened anew at the next ring
                os.close(self._fd)
                self._fd = -1
                if err.errno not in (errno.EPIPE, errno.EBADF):
                    raise

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class Listener:
    """The waiting side: a descriptor that is readable once a ring came (``fileno``, for an
    event loop), or ``wait`` on a thread. Opened read-write: a FIFO with no writer would read
    as end-of-file, readable for ever."""

    def __init__(self, path: str, blocking: bool = False) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (0 if blocking else os.O_NONBLOCK)
        self._fd = os.open(path, flags)

    def fileno(self) -> int:
        return self._fd

    def drain(self) -> int:
        """Take every ring that came (non-blocking listener); how many."""
        n = 0
        while True:
            try:
                got = os.read(self._fd, 4096)
            except BlockingIOError:
                return n
            if not got:
                return n
            n += len(got)

    def wait(self) -> int:
        """Block until a ring comes (blocking listener); how many were read."""
        return len(os.read(self._fd, 4096))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
