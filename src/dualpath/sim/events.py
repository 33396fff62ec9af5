"""Discrete-event loop of the simulator: a time-ordered heap of cancellable callbacks.

Owns simulated time (``now``, seconds) and the processed-event log hash. Knows nothing
about networks, engines or policies; callbacks carry all meaning.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import math
from array import array
from collections.abc import Callable
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    """Tie order of the simulator's events at one instant (lower runs first); every
    ``EventLoop.at`` / ``after`` in the simulator names one of these."""

    COMPLETION = 0  # something finished: a flow landed, a pass or decode interval ended
    START = 1  # start work after every completion of the instant (batch what arrived together)
    PULL = 3  # the group leaders pull from the policy after every start of the instant
    SETTLE = 2**62  # the network recomputes its rates after every other event of the instant


_LOG_CHUNK = 512  # processed events held before folding into the hash (small: cache-friendly)
_COMPACT_MIN = 4_096  # rebuild the heap when at least this many cancelled entries...
_COMPACT_FRACTION = 0.5  # ...make up more than this fraction of it
# While events run, Python's cyclic collector runs a young collection every GC_YOUNG net
# container allocations (CPython's default is 700) and skips everything that existed when
# the run started (``gc.freeze``: the workload, the cluster, the caller's objects; unfrozen
# at the end; a caller's own freeze is kept). Measured on the 48P96D paper-scale window
# (49,152 agents, to simulated 20 s; docs/simulator.md): 414 collections took 1.12 s of a
# 15.3 CPU s run; with these settings 12 took 0.25 s (run 12.4 -> 10.0 CPU s). Results cannot change: nothing in the
# simulator has a finalizer or depends on when memory is freed (the digests say so).
GC_YOUNG = 20_000


class Event(list[Any]):
    """Handle of a scheduled callback; also its heap entry ``[time_s, priority, seq, callback,
    label]`` (a list so heap comparisons run in C). Read it through the properties; only the
    loop mutates it. ``callback`` is cleared once the event is processed or cancelled."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]  # identity: handles can key dicts
        return id(self)

    @property
    def time_s(self) -> float:
        return float(self[0])

    @property
    def priority(self) -> int:
        return int(self[1])

    @property
    def seq(self) -> int:
        return int(self[2])

    @property
    def label(self) -> str:
        return str(self[4])

    @property
    def is_pending(self) -> bool:
        """True until the event is processed or cancelled."""
        return self[3] is not None


class EventLoop:
    """Runs callbacks in order of ``(time_s, priority, seq)``.

    Tie order: at equal times the lower ``priority`` value runs first; at equal time and
    priority, events run in the order they were scheduled (``seq`` is a per-loop counter).
    A callback may schedule events at ``now`` (they run in this same instant, after every
    already-scheduled event with a smaller key) but never in the past. Cancellation is lazy:
    a cancelled entry stays in the heap, is skipped when reached, and is not logged.
    """

    __slots__ = (
        "_hash",
        "_heap",
        "_log",
        "_num_cancelled",
        "_num_folded",
        "_running",
        "_seq",
        "now",
    )

    def __init__(self) -> None:
        self.now: float = 0.0
        self._heap: list[Event] = []
        self._seq = 0
        self._num_cancelled = 0  # cancelled entries still in the heap
        self._running = False
        self._hash = hashlib.sha256()
        self._log: list[Event] = []
        self._num_folded = 0

    def at(
        self, time_s: float, callback: Callable[[], object], priority: int = 0, label: str = ""
    ) -> Event:
        """Schedule ``callback()`` at absolute time ``time_s`` (finite, >= now). ``priority``:
        an int in the int64 range, lower runs first at equal times; ``label``: a str, logged."""
        if not self.now <= time_s < math.inf:
            raise ValueError(
                f"event time_s={time_s!r} is invalid: must be finite and >= now={self.now!r}"
            )
        if not (isinstance(priority, int) and isinstance(label, str)):
            raise _bad_tag(priority, label)
        seq = self._seq
        self._seq = seq + 1
        event = Event((time_s, priority, seq, callback, label))
        heapq.heappush(self._heap, event)
        return event

    def after(
        self, delay_s: float, callback: Callable[[], object], priority: int = 0, label: str = ""
    ) -> Event:
        """Schedule ``callback()`` ``delay_s`` (finite, >= 0) seconds from now."""
        time_s = self.now + delay_s
        if not (delay_s >= 0.0 and time_s < math.inf):
            raise ValueError(f"event delay_s={delay_s!r} is invalid: must be finite and >= 0")
        if not (isinstance(priority, int) and isinstance(label, str)):
            raise _bad_tag(priority, label)
        seq = self._seq
        self._seq = seq + 1
        event = Event((time_s, priority, seq, callback, label))
        heapq.heappush(self._heap, event)
        return event

    def cancel(self, event: Event) -> None:
        """Cancel ``event``; a no-op if it was already processed or cancelled."""
        if event[3] is None:
            return
        event[3] = None
        self._num_cancelled += 1
        heap = self._heap
        if self._num_cancelled >= _COMPACT_MIN and self._num_cancelled > _COMPACT_FRACTION * len(
            heap
        ):
            heap[:] = [e for e in heap if e[3] is not None]
            heapq.heapify(heap)
            self._num_cancelled = 0

    def run(self, until_s: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Process events in order until the heap is empty, the next event is later than
        ``until_s`` (events at exactly ``until_s`` are processed; ``now`` then becomes
        ``until_s``), or ``stop()`` returns True after an event (``now`` stays at that event).
        """
        if until_s is not None and not until_s >= self.now:
            raise ValueError(f"run until_s={until_s!r} is invalid: must be >= now={self.now!r}")
        if self._running:
            raise RuntimeError("EventLoop.run called from inside a callback")
        self._running = True
        threshold = gc.get_threshold()
        freeze = not gc.get_freeze_count()  # a caller's own freeze is left as it is
        if freeze:
            gc.freeze()
        gc.set_threshold(max(GC_YOUNG, threshold[0]), *threshold[1:])
        try:
            stopped = self._drain(math.inf if until_s is None else until_s, stop)
        finally:
            self._running = False
            gc.set_threshold(*threshold)
            if freeze:
                gc.unfreeze()
        if until_s is not None and not stopped:
            self.now = until_s

    def _drain(self, limit_s: float, stop: Callable[[], bool] | None) -> bool:
        heap = self._heap
        pop = heapq.heappop
        log = self._log  # processed events themselves; folded into the hash per chunk
        append = log.append
        while heap:
            event = pop(heap)
            callback = event[3]
            if callback is None:
                self._num_cancelled -= 1
                continue
            time_s = event[0]
            if time_s > limit_s:
                heapq.heappush(heap, event)
                return False
            event[3] = None
            self.now = time_s
            append(event)
            if len(log) >= _LOG_CHUNK:
                self._fold_log()
            callback()
            if stop is not None and stop():
                return True
        return False

    def _fold_log(self) -> None:
        _fold(self._hash, self._log)
        self._num_folded += len(self._log)
        self._log.clear()

    @property
    def num_processed(self) -> int:
        """Events whose callback has run (cancelled ones excluded)."""
        return self._num_folded + len(self._log)

    @property
    def num_pending(self) -> int:
        """Scheduled events not yet processed or cancelled."""
        return len(self._heap) - self._num_cancelled

    def log_digest(self) -> str:
        """SHA-256 (hex) over every processed event's (time_s, priority, label), in order.
        Equal digests ⇒ identical event histories (on the same float byte order)."""
        h = self._hash.copy()
        _fold(h, self._log)
        return h.hexdigest()


def _bad_tag(priority: object, label: object) -> ValueError:
    if not isinstance(priority, int):
        return ValueError(f"event priority={priority!r} is invalid: must be an int")
    return ValueError(f"event label={label!r} is invalid: must be a str")


def _fold(h: Any, log: list[Event]) -> None:
    """Hash one chunk of processed events. Chunk boundaries fall at fixed event counts, so the
    digest depends only on the sequence of processed events."""
    if not log:
        return
    h.update(len(log).to_bytes(8, "little"))
    h.update(array("d", [e[0] for e in log]).tobytes())
    h.update(array("q", [e[1] for e in log]).tobytes())
    h.update("\x1f".join([e[4] for e in log]).encode())
