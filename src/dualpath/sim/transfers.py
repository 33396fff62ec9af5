"""Starts data transfers on the fluid network and reports the KV bytes of each load path to
the core's ``RunCounters`` (design §4–§6).

In the Oracle system reads, H2D/D2H and PD transfers take zero time: they complete at once
and move no bytes. Collectives (model execution) and persistence writes always take time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dualpath.ledger import EventBus, RunCounters, TransferDone
from dualpath.ledger.counters import SIM_PATHS
from dualpath.sim.events import EventLoop, Priority
from dualpath.sim.network import FluidNetwork
from dualpath.types import KVPath, TrafficClass

# the one kind of flow that is no KV load path: a PE group's MoE collectives
COLLECTIVES = "collectives"
# Path kinds, in report order (bytes per path in the results): the KV paths by their one name
# (``types.KVPath``; the simulator knows each layer load's source buffer), then collectives.
PATH_KINDS: tuple[str, ...] = (*(p.value for p in SIM_PATHS), COLLECTIVES)
# the hops of the reuse designs (docs/peers.md): counted only in their systems' runs
REUSE_KINDS: tuple[str, ...] = (KVPath.PE_DRAM_TO_PE_HBM.value, KVPath.PEER_TO_PE_HBM.value)
_LABELS = {kind: f"done:{kind}" for kind in (*PATH_KINDS, *REUSE_KINDS)}
# What the Oracle gets for free (design §11): storage reads, H2D/D2H and PD transfers.
# Persistence writes and collectives still take time (neither gates any request).
ORACLE_FREE = frozenset(PATH_KINDS) - {KVPath.DE_TO_STORAGE, COLLECTIVES}


class Transfers:
    """``start(kind, path, bytes, on_done)``: one flow of ``kind`` (a ``KVPath`` of
    ``SIM_PATHS``, or ``COLLECTIVES``); ``on_done`` runs when its last byte lands. Zero-byte
    transfers (and every KV transfer in the Oracle) finish at once, through the event loop so
    that callers never re-enter themselves. A KV flow's bytes are counted in ``counters``
    (the core's) when it starts, a collective's in ``collective_bytes``. A flow that takes
    time is reported to ``events`` as a ``TransferDone`` when it lands (if anyone
    subscribed)."""

    def __init__(
        self,
        loop: EventLoop,
        net: FluidNetwork,
        *,
        oracle: bool,
        events: EventBus | None = None,
        counters: RunCounters | None = None,
    ) -> None:
        self.loop = loop
        self.net = net
        self.oracle = oracle
        self.events = events if events is not None else EventBus()
        self.counters = counters if counters is not None else RunCounters.over(SIM_PATHS)
        missing = [str(p) for p in SIM_PATHS if p not in self.counters.bytes_by_path]
        if missing:
            raise ValueError(
                f"counters is invalid: its bytes_by_path has no {missing} "
                "(the simulator counts ledger.counters.SIM_PATHS)"
            )
        self._kv_bytes = self.counters.bytes_by_path  # by KVPath: a kind's str value is its key
        self.collective_bytes = 0.0
        self.flows_by_kind: dict[str, int] = dict.fromkeys((*PATH_KINDS, *REUSE_KINDS), 0)
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
        self.flows_by_kind[kind] += 1
        self.num_flows += 1
        if kind == COLLECTIVES:
            self.collective_bytes += size_bytes
            klass = TrafficClass.HIGH
        else:
            self._kv_bytes[kind] += size_bytes  # ``counters.moved``, without a KVPath(kind)
            klass = TrafficClass.LOW
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

    def path_bytes(self) -> dict[str, float]:
        """Bytes per path kind, in ``PATH_KINDS`` order: the KV paths' from ``counters``."""
        kv = self.counters.bytes_by_path
        reused = {k: kv[k] for k in REUSE_KINDS if k in kv}  # a reuse design's run only
        return {**{str(p): kv[p] for p in SIM_PATHS}, COLLECTIVES: self.collective_bytes, **reused}

    def nominal_s(self, path: Sequence[int], size_bytes: float) -> float:
        """Uncontended duration: ``size_bytes`` over the slowest resource of ``path`` (0 for
        what the Oracle gets for free is the caller's business)."""
        return size_bytes / min(self.net.capacity(r) for r in path)
