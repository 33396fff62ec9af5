"""Emulated NICs and DRAM (design §2, §6): a link of fixed bytes/s shared by two traffic classes.

A ``Pacer`` is one direction of one NIC (or a node's half-duplex DRAM). Transfers are cut into
quanta; each quantum reserves the link for ``quantum / rate`` seconds and the caller sleeps
until its bytes have "arrived". Quanta are granted only when the link is (nearly) free, by
weighted fair queueing between HIGH (model collectives, weight ≈ 99%) and LOW (KV, ≥ 1%
floor, all idle capacity), which is what the CNIC's hardware weighted-round-robin arbiter
does. Waiters sleep on a condition variable with a deadline: never a busy spin.

A link's state is either local to the process (threads share it) or a ``SharedLink`` in
shared memory, so that several processes charge one link: a transfer between two engines is
charged on the sender's ``tx`` and the receiver's ``rx`` (``transfer_all``), each engine
owning its links. Each queued ticket records its process id: a waiter that finds the link
idle behind the ticket of a dead process (e.g. a killed storage worker's) skips that ticket,
and the link's lock is an ``flock`` on a file (``LinkLock``), which the kernel releases when
its holder dies, so a process killed anywhere, even inside a grant, never stalls a link.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dualpath.types import TrafficClass

_CLASSES = (TrafficClass.HIGH, TrafficClass.LOW)
# the link's state: one float64 each (exact for integer counters below 2**53)
_BUSY_UNTIL, _BUSY_S = 0, 1
_SERVED, _NEXT, _HEAD, _BYTES = 2, 4, 6, 8  # + class index (HIGH 0, LOW 1)
_RING = 256  # owner pid of ticket t of class i at _OWNER + i·_RING + t % _RING
_OWNER = 10
_STATE_LEN = _OWNER + 2 * _RING
_STALE_CHECK_S = 0.2  # a waiter behind an idle link this long checks the head's owner
_POLL_S = 2e-4  # a cross-process waiter re-checks the link this often


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ix(klass: TrafficClass) -> int:
    return 0 if klass is TrafficClass.HIGH else 1


@dataclass(slots=True)
class PacerStats:
    """Bytes carried per class and the time the link was reserved (busy)."""

    bytes_by_class: dict[TrafficClass, int] = field(
        default_factory=lambda: {c: 0 for c in _CLASSES}
    )
    busy_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_class.values())


class LinkLock:
    """A cross-process lock that the kernel releases when its holder dies: ``flock`` on the
    file ``path``, which each process opens once (flock excludes open file descriptions, so
    the processes exclude each other) behind a thread lock (the threads of one process share
    that description). A semaphore (``multiprocessing.Lock``) held by a killed process would
    stay taken for ever. Pickles as its path: a spawned child opens its own description."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._threads = threading.Lock()
        self._fd = -1
        self._pid = 0

    def __getstate__(self) -> str:
        return self.path

    def __setstate__(self, path: str) -> None:
        self.__init__(path)  # type: ignore[misc]

    def _file(self) -> int:
        if self._pid != os.getpid():  # first use in this process (or a forked child)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
        return self._fd

    def acquire(self) -> bool:
        self._threads.acquire()
        try:
            fcntl.flock(self._file(), fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise
        return True

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def close(self) -> None:
        """Close this process's descriptor (the file stays; its creator removes it)."""
        if self._pid == os.getpid() and self._fd >= 0:
            os.close(self._fd)
        self._fd, self._pid = -1, 0


@dataclass(frozen=True, slots=True)
class SharedLink:
    """One link's state in shared memory plus the lock that guards it; created by the parent
    (``create``, the lock's file at ``lock_path``, which the parent removes after the run) and
    handed to child processes at spawn."""

    state: Any  # multiprocessing RawArray("d", _STATE_LEN)
    lock: Any  # LinkLock

    @classmethod
    def create(cls, ctx: Any, lock_path: str) -> SharedLink:
        with open(lock_path, "a"):  # exists before any process opens it
            pass
        return cls(ctx.RawArray("d", _STATE_LEN), LinkLock(lock_path))


class _PollingCondition:
    """The condition interface over a cross-process lock: ``wait`` releases the lock and
    sleeps (its timeout: the link is busy until then, so nothing can be granted earlier; or,
    without one, ``_POLL_S``) instead of being notified. A multiprocessing Condition's
    ``notify_all`` blocks until every sleeper has woken, which on a loaded host costs a
    context switch per waiter on every grant."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> bool:
        return bool(self._lock.acquire())

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        self._lock.release()
        try:
            time.sleep(_POLL_S if timeout is None else max(0.0, timeout))
        finally:
            self._lock.acquire()
        return timeout is None

    def notify_all(self) -> None:
        return None


class Pacer:
    """One direction of an emulated NIC (or a DRAM) at ``rate_bytes_per_s``; ``link``: shared
    state, so that other processes' pacers over the same link contend with this one."""

    def __init__(
        self,
        rate_bytes_per_s: float,
        name: str = "nic",
        low_weight: float = 0.01,
        quantum_s: float = 0.001,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        link: SharedLink | None = None,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"{name}: rate_bytes_per_s={rate_bytes_per_s} must be > 0")
        if not 0 < low_weight < 1:
            raise ValueError(f"{name}: low_weight={low_weight} must be in (0, 1)")
        self.name = name
        self.rate_bytes_per_s = rate_bytes_per_s
        self._weights = (1.0 - low_weight, low_weight)  # HIGH, LOW
        self._quantum_bytes = max(4096, int(rate_bytes_per_s * quantum_s))
        self._slack_s = self._quantum_bytes / rate_bytes_per_s  # grant one quantum ahead
        self._clock = clock
        self._sleep = sleep
        self._s: Any = link.state if link is not None else [0.0] * _STATE_LEN
        self._cond: Any = _PollingCondition(link.lock) if link else threading.Condition()
        self._shared = link is not None
        self.grant_log: list[TrafficClass] | None = None  # set to [] to record grant order

    @property
    def stats(self) -> PacerStats:
        """A snapshot (of every process's charges, for a shared link)."""
        with self._cond:
            s = self._s
            return PacerStats({c: int(s[_BYTES + _ix(c)]) for c in _CLASSES}, s[_BUSY_S])

    def _waiting(self, i: int) -> bool:
        return self._s[_NEXT + i] > self._s[_HEAD + i]

    def _pick(self) -> int | None:
        """Class index to serve next: the waiting class least served relative to its weight."""
        waiting = [i for i in (0, 1) if self._waiting(i)]
        if not waiting:
            return None
        return min(waiting, key=lambda i: (self._s[_SERVED + i], i))

    def transfer(self, nbytes: int, klass: TrafficClass = TrafficClass.LOW) -> None:
        """Block until ``nbytes`` have crossed the link in class ``klass``."""
        self._sleep_until(self.reserve(nbytes, klass))

    def reserve(self, nbytes: int, klass: TrafficClass = TrafficClass.LOW) -> float:
        """Reserve the link for ``nbytes`` in class ``klass``; returns when the bytes will
        have arrived (clock time). Blocks only while the link is busy with earlier quanta.

        The transfer keeps its place in its class's FIFO until its last quantum is granted,
        and requests each quantum while the previous one is still in flight (link never idles
        between quanta of a busy class)."""
        if nbytes <= 0:
            return self._clock()
        i, s = _ix(klass), self._s
        with self._cond:
            if not self._waiting(i):  # an idle class does not bank credit while away
                j = 1 - i
                other = s[_SERVED + j] if self._waiting(j) else 0.0
                s[_SERVED + i] = max(s[_SERVED + i], other)
            ticket = s[_NEXT + i]
            s[_NEXT + i] = ticket + 1
            s[_OWNER + i * _RING + int(ticket) % _RING] = os.getpid()
            self._cond.notify_all()
            remaining = nbytes
            while remaining > 0:
                chunk = min(remaining, self._quantum_bytes)
                self._grant(chunk, i, ticket)
                remaining -= chunk
            s[_HEAD + i] = max(s[_HEAD + i], ticket + 1)
            self._cond.notify_all()
            return float(s[_BUSY_UNTIL])

    def _grant(self, nbytes: int, i: int, ticket: float) -> None:
        """Wait (lock held) until ``ticket`` may send its next quantum, then reserve the link."""
        s = self._s
        idle_since: float | None = None
        while True:
            now = self._clock()
            lead_s = s[_BUSY_UNTIL] - now
            if self._pick() == i and s[_HEAD + i] >= ticket and lead_s <= self._slack_s:
                break
            if lead_s > self._slack_s:
                self._cond.wait(timeout=lead_s - self._slack_s)
                idle_since = None
            elif self._shared:  # idle link, not our turn: is the head's owner still alive?
                idle_since = now if idle_since is None else idle_since
                if now - idle_since > _STALE_CHECK_S:
                    self._skip_dead_heads()
                    idle_since = None
                self._cond.wait()
            else:
                self._cond.wait()
        s[_BUSY_UNTIL] = max(now, s[_BUSY_UNTIL]) + nbytes / self.rate_bytes_per_s
        s[_SERVED + i] += nbytes / self._weights[i]
        s[_BYTES + i] += nbytes
        s[_BUSY_S] += nbytes / self.rate_bytes_per_s
        if self.grant_log is not None:
            self.grant_log.append(_CLASSES[i])
        self._cond.notify_all()

    def _skip_dead_heads(self) -> None:
        """Drop queued tickets whose process died (lock held)."""
        s = self._s
        for j in (0, 1):
            while self._waiting(j):
                owner = int(s[_OWNER + j * _RING + int(s[_HEAD + j]) % _RING])
                if _pid_alive(owner):
                    break
                s[_HEAD + j] += 1
                self._cond.notify_all()

    def _sleep_until(self, t: float) -> None:
        delay = t - self._clock()
        if delay > 0:
            self._sleep(delay)


def transfer_all(pacers: Sequence[Pacer], nbytes: int, klass: TrafficClass) -> None:
    """Charge one transfer on every link it crosses (sender's tx, receiver's rx, DRAM): it is
    reserved on each link in turn (never holding one link's queue while waiting for another,
    so there is no deadlock) and has arrived when the slowest link has carried it: links in
    parallel, cut-through, never the sum of their times."""
    if not pacers:
        return
    finish = max(p.reserve(nbytes, klass) for p in pacers)
    pacers[0]._sleep_until(finish)


@dataclass(slots=True)
class NicPacer:
    """A full-duplex NIC: independent transmit and receive directions."""

    tx: Pacer
    rx: Pacer

    @classmethod
    def of(
        cls,
        rate_bytes_per_s: float,
        name: str,
        low_weight: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        links: tuple[SharedLink, SharedLink] | None = None,
    ) -> NicPacer:
        tx_link, rx_link = links if links is not None else (None, None)
        return cls(
            Pacer(rate_bytes_per_s, f"{name}.tx", low_weight, clock=clock, link=tx_link),
            Pacer(rate_bytes_per_s, f"{name}.rx", low_weight, clock=clock, link=rx_link),
        )
