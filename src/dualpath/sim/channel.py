"""A coalescing transfer channel: one flow in flight on a fixed path; whatever is queued
meanwhile goes as the next flow.

Used for each DE's H2D (DE buffer → HBM through its own CNIC) and each decode node's
persistence writes (DRAM → SNIC write): it keeps the number of concurrent flows, and so the
network's work, proportional to the number of engines instead of requests. Items complete
when the flow that carried them lands (FIFO batches). ``min_gap_s`` spaces flow starts
(persistence: writes gate nothing, so they may wait to be batched).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from dualpath.sim.events import Priority
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath

T = TypeVar("T")


class Channel(Generic[T]):
    def __init__(
        self,
        kind: KVPath,
        path: tuple[int, ...],
        transfers: Transfers,
        on_done: Callable[[list[T]], None] | None = None,
        min_gap_s: float = 0.0,
        coalesce: bool = True,
    ) -> None:
        self.kind = kind
        # False: each send is its own flow, in order (an item lands when its own bytes and
        # those sent before it have, as in a per-block write queue), not batched with later ones
        self.coalesce = coalesce
        self.backlog: deque[tuple[float, T | None]] = deque()
        self.min_gap_s = min_gap_s  # flows start at least this far apart (batches more)
        self.last_start_s = -float("inf")
        self.waiting = False  # a delayed flush is scheduled
        self.path = path
        self.transfers = transfers
        self.on_done = on_done
        self.queued_bytes = 0.0
        self.queued: list[T] = []
        self.in_flight: list[T] = []
        self.busy = False
        self.num_flows = 0

    def send(self, size_bytes: float, item: T | None = None) -> None:
        """Queue ``size_bytes`` (and ``item``, reported back when its bytes have landed)."""
        if not self.coalesce:
            self.backlog.append((size_bytes, item))
            if not self.busy and not self.waiting:
                self._flush()
            return
        self.queued_bytes += size_bytes
        if item is not None:
            self.queued.append(item)
        if not self.busy and not self.waiting:
            self._flush()

    def _flush(self) -> None:
        self.waiting = False
        if self.backlog and not self.queued and self.queued_bytes <= 0:
            size_bytes, item = self.backlog.popleft()
            self.queued_bytes = size_bytes
            if item is not None:
                self.queued.append(item)
        if self.queued_bytes <= 0 and not self.queued:
            self.busy = False
            return
        loop = self.transfers.loop
        due = self.last_start_s + self.min_gap_s
        if loop.now < due:
            self.busy = False
            self.waiting = True
            loop.at(due, self._flush, Priority.COMPLETION, "channel_flush")
            return
        self.last_start_s = loop.now
        size, self.queued_bytes = self.queued_bytes, 0.0
        self.in_flight, self.queued = self.queued, []
        self.busy = True
        self.num_flows += 1
        self.transfers.start(self.kind, self.path, size, self._landed)

    def _landed(self) -> None:
        items, self.in_flight = self.in_flight, []
        if self.on_done is not None and items:
            self.on_done(items)
        self._flush()
