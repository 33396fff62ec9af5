"""Starts data transfers on the fluid network and counts bytes per path (SPEC §4–§6).

In the Oracle system reads, H2D/D2H and PD transfers take zero time: they complete at once
and move no bytes. Collectives (model execution) and persistence writes always take time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dualpath.ledger import EventBus, TransferDone
from dualpath.sim.events import EventLoop, Priority
from dualpath.sim.network import FluidNetwork
from dualpath.types import KVPath, TrafficClass

# Path kinds, in report order (bytes per path in the results): the KV paths by their one name
# (``types.KVPath``; the simulator knows each layer load's source buffer), then collectives.
PATH_KINDS: tuple[str, ...] = (
    *(p.value for p in KVPath if p is not KVPath.BUFFER_TO_PE_HBM),
    "collectives",
)
_LABELS = {kind: f"done:{kind}" for kind in PATH_KINDS}
# What the Oracle gets for free (SPEC §11): storage reads, H2D/D2H and PD transfers.
# Persistence writes and collectives still take time (neither gates any request).
ORACLE_FREE = frozenset(PATH_KINDS) - {KVPath.DE_TO_STORAGE.value, "collectives"}


class Transfers:
    """``start(kind, path, bytes, on_done)``: one flow; ``on_done`` runs when its last byte
    lands. Zero-byte transfers (and every KV transfer in the Oracle) finish at once, through
    the event loop so that callers never re-enter themselves. A flow that takes time is
    reported to ``events`` as a ``TransferDone`` when it lands (if anyone subscribed)."""

    def __init__(
        self,
        loop: EventLoop,
        net: FluidNetwork,
        *,
        oracle: bool,
        events: EventBus | None = None,
    ) -> None:
        self.loop = loop
        self.net = net
        self.oracle = oracle
        self.events = events if events is not None else EventBus()
        self.bytes_by_kind: dict[str, float] = dict.fromkeys(PATH_KINDS, 0.0)
        self.flows_by_kind: dict[str, int] = dict.fromkeys(PATH_KINDS, 0)
        self.num_flows = 0

    def start(
        self,
        kind: str,
        path: Sequence[int],
        size_bytes: float,
        on_done: Callable[[], None],
        max_rate_bytes_per_s: float = math.inf,
    ) -> None:
        if size_bytes <= 0 or (self.oracle and kind in ORACLE_FREE):
            self.loop.at(self.loop.now, on_done, Priority.COMPLETION, _LABELS[kind])
            return
        self.bytes_by_kind[kind] += size_bytes
        self.flows_by_kind[kind] += 1
        self.num_flows += 1
        klass = TrafficClass.HIGH if kind == "collectives" else TrafficClass.LOW
        if self.events.wants(TransferDone):
            on_done = self._reported(kind, tuple(path), size_bytes, on_done)
        self.net.start_flow(path, size_bytes, klass, on_done, max_rate_bytes_per_s)

    def _reported(
        self, kind: str, path: tuple[int, ...], size_bytes: float, on_done: Callable[[], None]
    ) -> Callable[[], None]:
        start_s, loop, events = self.loop.now, self.loop, self.events

        def done() -> None:
            events.emit(TransferDone(loop.now, kind, path, size_bytes, start_s))
            on_done()

        return done

    def nominal_s(self, path: Sequence[int], size_bytes: float) -> float:
        """Uncontended duration: ``size_bytes`` over the slowest resource of ``path`` (0 for
        what the Oracle gets for free is the caller's business)."""
        return size_bytes / min(self.net.capacity(r) for r in path)
