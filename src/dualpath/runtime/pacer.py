"""Emulated NICs (SPEC §2, §6): a link of fixed bytes/s shared by two traffic classes.

A ``Pacer`` is one direction of one NIC. Transfers are cut into quanta; each quantum reserves
the link for ``quantum / rate`` seconds and the caller sleeps until its bytes have "arrived".
Quanta are granted only when the link is (nearly) free, by weighted fair queueing between
HIGH (model collectives, weight ≈ 99%) and LOW (KV, ≥ 1% floor, all idle capacity), which is
what the CNIC's hardware weighted-round-robin arbiter does. Waiters sleep on a condition
variable with a deadline: never a busy spin. Thread-safe, per process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dualpath.types import TrafficClass

_CLASSES = (TrafficClass.HIGH, TrafficClass.LOW)


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


class Pacer:
    """One direction of an emulated NIC at ``rate_bytes_per_s``."""

    def __init__(
        self,
        rate_bytes_per_s: float,
        name: str = "nic",
        low_weight: float = 0.01,
        quantum_s: float = 0.001,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"{name}: rate_bytes_per_s={rate_bytes_per_s} must be > 0")
        if not 0 < low_weight < 1:
            raise ValueError(f"{name}: low_weight={low_weight} must be in (0, 1)")
        self.name = name
        self.rate_bytes_per_s = rate_bytes_per_s
        self._weights = {TrafficClass.HIGH: 1.0 - low_weight, TrafficClass.LOW: low_weight}
        self._quantum_bytes = max(4096, int(rate_bytes_per_s * quantum_s))
        self._slack_s = self._quantum_bytes / rate_bytes_per_s  # grant one quantum ahead
        self._clock = clock
        self._sleep = sleep
        self._cond = threading.Condition()
        self._queues: dict[TrafficClass, deque[int]] = {c: deque() for c in _CLASSES}
        self._served: dict[TrafficClass, float] = {c: 0.0 for c in _CLASSES}  # bytes / weight
        self._busy_until = 0.0
        self._next_ticket = 0
        self.stats = PacerStats()
        self.grant_log: list[TrafficClass] | None = None  # set to [] to record grant order

    def _pick(self) -> TrafficClass | None:
        """Class to serve next: the waiting class least served relative to its weight."""
        waiting = [c for c in _CLASSES if self._queues[c]]
        if not waiting:
            return None
        return min(waiting, key=lambda c: (self._served[c], c.value))

    def transfer(self, nbytes: int, klass: TrafficClass = TrafficClass.LOW) -> None:
        """Block until ``nbytes`` have crossed the link in class ``klass``.

        The transfer keeps its place in its class's FIFO until its last quantum is granted,
        and requests each quantum while the previous one is still in flight (link never idles
        between quanta of a busy class)."""
        if nbytes <= 0:
            return
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            queue = self._queues[klass]
            if not queue:  # an idle class does not bank credit while away
                others = [self._served[c] for c in _CLASSES if c is not klass and self._queues[c]]
                self._served[klass] = max(self._served[klass], min(others, default=0.0))
            queue.append(ticket)
            self._cond.notify_all()
            remaining = nbytes
            while remaining > 0:
                chunk = min(remaining, self._quantum_bytes)
                self._grant(chunk, klass, ticket)
                remaining -= chunk
            queue.popleft()
            self._cond.notify_all()
            finish = self._busy_until
        self._sleep_until(finish)

    def _grant(self, nbytes: int, klass: TrafficClass, ticket: int) -> None:
        """Wait (lock held) until ``ticket`` may send its next quantum, then reserve the link."""
        queue = self._queues[klass]
        while True:
            now = self._clock()
            lead_s = self._busy_until - now
            if self._pick() is klass and queue[0] == ticket and lead_s <= self._slack_s:
                break
            self._cond.wait(timeout=lead_s - self._slack_s if lead_s > self._slack_s else None)
        self._busy_until = max(now, self._busy_until) + nbytes / self.rate_bytes_per_s
        self._served[klass] += nbytes / self._weights[klass]
        self.stats.bytes_by_class[klass] += nbytes
        self.stats.busy_s += nbytes / self.rate_bytes_per_s
        if self.grant_log is not None:
            self.grant_log.append(klass)
        self._cond.notify_all()

    def _sleep_until(self, t: float) -> None:
        delay = t - self._clock()
        if delay > 0:
            self._sleep(delay)


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
    ) -> NicPacer:
        return cls(
            Pacer(rate_bytes_per_s, f"{name}.tx", low_weight, clock=clock),
            Pacer(rate_bytes_per_s, f"{name}.rx", low_weight, clock=clock),
        )
