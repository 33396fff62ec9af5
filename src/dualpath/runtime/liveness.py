"""Whether a process lives, decided by the process itself (Linux ``/proc``: its pid, its start
time, its state), never by an exit code a parent left; how a process is killed and confirmed
gone before what it held is touched. Owns no state; a caller keeps its ``ProcId``s.

``multiprocessing`` reports every child of a dead fork server as exited (code 255) while it
still runs, and its ``Process.kill`` then does nothing: the runtime never asks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass

GONE_POLL_S = 0.005  # how often a kill's confirmation looks again
KILL_CONFIRM_S = 5.0  # a SIGKILLed process is a zombie within this (else: stuck in the kernel)
PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


@dataclass(frozen=True, slots=True)
class ProcId:
    """One process: ``pid`` plus its start time (clock ticks since boot, as ``/proc`` gives
    it), so that a pid reused by another process is never taken for it. ``start`` is "" for
    a process that was gone before it could be read: never running."""

    pid: int
    start: str

    @classmethod
    def of(cls, pid: int) -> ProcId:
        stat = _stat(pid)
        return cls(pid, "" if stat is None else stat[1])


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of ``pid`` from ``/proc/PID/stat``; None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


def start_time(pid: int) -> str | None:
    """``pid``'s start time (None: no such process)."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def is_running(proc: ProcId) -> bool:
    """``proc`` exists, is the same process (start time) and is not a zombie. A stopped
    (SIGSTOP) process is running: whether it still serves is the heartbeat's question."""
    stat = _stat(proc.pid)
    return (
        stat is not None
        and bool(proc.start)
        and stat[1] == proc.start
        and stat[0] not in ("Z", "X")
    )


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is this process's child and has exited (a child of
    a dead fork server is ours once we are its subreaper, ``adopt_orphans``)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def wait_gone(proc: ProcId, timeout_s: float) -> bool:
    """Wait until ``proc`` is no longer running (reaping it if it is ours); whether it is."""
    deadline = time.monotonic() + timeout_s
    while is_running(proc):
        if time.monotonic() >= deadline:
            return False
        time.sleep(GONE_POLL_S)
    reap(proc.pid)
    return True


def kill_confirmed(proc: ProcId, timeout_s: float = KILL_CONFIRM_S) -> bool:
    """SIGKILL ``proc`` (if it still runs) and wait until the kernel has taken it down: its
    locks (flock), pipes and mappings are released once this returns True. False: it did not
    die within ``timeout_s`` (stuck in uninterruptible sleep), nothing it held may be touched."""
    if is_running(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    return wait_gone(proc, timeout_s)


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants (Linux): a process orphaned by a
    dead fork server becomes our child, so that it is reaped here when it exits instead of
    staying a zombie under a PID 1 that reaps nothing (a container's server). Call it in a
    process that owns its runtime (the server's scheduler process, the CLI), not in a test
    runner whose other children it would adopt."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
