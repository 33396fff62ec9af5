"""The router's ``/metrics``: the DualPath counters in ``dualpath serve``'s names, from the flow's
stats and a ``NodeSnapshot`` of the side-cars and buffers.

The snapshot is taken off the event loop (``take_snapshot``: a side-car RPC and a buffer lock
per node) before each scrape; ``collect`` itself does no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dualpath.frontend.metrics import (
    aborted_family,
    kv_bytes_family,
    persist_failed_family,
    prefix_cache_families,
)
from dualpath.integrations.vllm.flow import TurnFlow
from dualpath.types import KVPath


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """What the side-cars said (``stats``; ``down`` for one that did not answer) and each
    node buffer's free and total slots."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    free_slots: dict[int, int] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)


def take_snapshot(flow: TurnFlow) -> NodeSnapshot:
    """Blocking (side-car RPCs, buffer locks): run it in a thread."""
    free, total = {}, {}
    for node, buf in sorted(flow.buffers.items()):
        try:
            free[node], total[node] = buf.num_free, buf.spec.num_slots
        except (OSError, ValueError):  # being re-attached after its side-car's restart
            continue
    return NodeSnapshot(flow.node_stats(), free, total)


class FlowCollector(Collector):
    """``snapshot`` is set by the ``/metrics`` route before each ``generate_latest``;
    ``restarts``: the supervisor's restarts per process."""

    def __init__(self, flow: TurnFlow, restarts: Mapping[str, int] | None = None) -> None:
        self._flow = flow
        self.snapshot = NodeSnapshot()
        self.restarts: Mapping[str, int] = restarts if restarts is not None else {}

    def collect(self) -> Iterator[Metric]:
        st = self._flow.stats
        nodes = self.snapshot.nodes
        by_path = dict(self._flow.counters.bytes_by_path)
        for kind, stored in (("de", KVPath.DE_TO_STORAGE), ("pe", KVPath.PE_TO_STORAGE)):
            written = sum(n.get("bytes_written", 0) for n in nodes if n.get("kind") == kind)
            if written or kind == "de":  # (a PE node writes only across nodes, for DualPath)
                by_path[stored.value] = by_path.get(stored.value, 0.0) + written
        yield kv_bytes_family(by_path)
        side = CounterMetricFamily("dualpath:reads", "Storage reads per read side", labels=["side"])
        for name in ("pe", "de"):
            side.add_metric([name], st.reads_by_side.get(name, 0))
        yield side
        yield from prefix_cache_families(st.prompt_tokens, st.hit_tokens)
        yield CounterMetricFamily("dualpath:requests_done", "Requests answered", value=st.num_done)
        yield aborted_family(st.num_aborted)
        busy = GaugeMetricFamily(
            "dualpath:snic_busy_seconds", "Emulated SNIC busy time", labels=["node", "direction"]
        )
        for n in nodes:
            if n.get("down"):
                continue
            busy.add_metric([str(n["node"]), "read"], n["read_busy_s"])
            busy.add_metric([str(n["node"]), "write"], n["write_busy_s"])
        yield busy
        yield from self._snic_queues()
        yield from self._cnic()
        yield from self._slots()
        yield from self._writes()
        stage = CounterMetricFamily(
            "dualpath:router_stage_seconds",
            "Seconds requests spent in each stage of the router",
            labels=["stage"],
        )
        for name, seconds in sorted(st.stage_s.items()):
            stage.add_metric([name], seconds)
        yield stage
        restarts = CounterMetricFamily(
            "dualpath:restarts", "Processes restarted by the supervisor", labels=["process"]
        )
        for name, count in sorted(self.restarts.items()):
            restarts.add_metric([name], count)
        yield restarts

    def _snic_queues(self) -> Iterator[Metric]:
        """Each node's SNIC read queue, as its side-car holds it: the signal the paper's
        scheduler chooses a read side by (arXiv 2602.21548 §4), which engines' own metrics lack."""
        nodes = [n for n in self.snapshot.nodes if not n.get("down")]
        for name, key, what in (
            ("dualpath:snic_read_requests_waiting", "read_requests_waiting", "Reads queued"),
            ("dualpath:snic_read_bytes_waiting", "read_bytes_waiting", "Bytes of reads queued"),
            ("dualpath:snic_read_requests_in_flight", "read_requests_in_flight", "Reads moving"),
            ("dualpath:snic_read_bytes_in_flight", "read_bytes_in_flight", "Bytes of reads moving"),
        ):
            g = GaugeMetricFamily(
                name, f"{what} on each node's SNIC (its side-car)", labels=["node", "kind"]
            )
            for n in nodes:
                g.add_metric([str(n["node"]), str(n.get("kind", ""))], n.get(key, 0))
            yield g
        spent = CounterMetricFamily(
            "dualpath:snic_read_seconds",
            "Seconds reads spent on each node's side-car: queued for a reader, in the store",
            labels=["node", "kind", "stage"],
        )
        for n in nodes:
            for stage, key in (("queued", "read_queued_s"), ("store", "read_store_s")):
                spent.add_metric([str(n["node"]), str(n.get("kind", "")), stage], n.get(key, 0.0))
        yield spent

    def _cnic(self) -> Iterator[Metric]:
        """KV each node's side-car pushed over the compute network: layer by layer while a
        prefill ran (the layerwise hand-over), or whole slots; and the slots a hand-over left
        to be pushed whole after the prefill (a layer that did not arrive)."""
        nodes = [n for n in self.snapshot.nodes if not n.get("down")]
        pushed = CounterMetricFamily(
            "dualpath:cnic_pushed_bytes",
            "KV bytes each node's side-car pushed to another node over the compute network",
            labels=["node", "mode"],
        )
        after = CounterMetricFamily(
            "dualpath:handover_slots_pushed_after",
            "Slots of layerwise hand-overs pushed whole after their prefill",
            labels=["node"],
        )
        for n in nodes:
            layerwise = n.get("bytes_forwarded", 0)
            pushed.add_metric([str(n["node"]), "layerwise"], layerwise)
            pushed.add_metric([str(n["node"]), "whole"], n.get("bytes_pushed", 0) - layerwise)
            after.add_metric([str(n["node"])], n.get("slots_pushed_after", 0))
        yield pushed
        yield after

    def _slots(self) -> Iterator[Metric]:
        snap = self.snapshot
        free = GaugeMetricFamily(
            "dualpath:buffer_free_slots", "Free slots of each node buffer", labels=["node"]
        )
        total = GaugeMetricFamily(
            "dualpath:buffer_slots", "Slots of each node buffer", labels=["node"]
        )
        for node in sorted(snap.slots):
            free.add_metric([str(node)], snap.free_slots[node])
            total.add_metric([str(node)], snap.slots[node])
        yield free
        yield total
        waiters = self._flow.slot_waiters
        yield GaugeMetricFamily(
            "dualpath:slot_waiters", "Requests waiting for buffer slots", value=waiters
        )

    def _writes(self) -> Iterator[Metric]:
        """KV writes that did not land, and why: none is ever dropped silently."""
        nodes = [n for n in self.snapshot.nodes if not n.get("down")]
        st = self._flow.stats
        pending = GaugeMetricFamily(
            "dualpath:kv_writes_pending", "Blocks queued for a write or in hand", labels=["node"]
        )
        refused = CounterMetricFamily(
            "dualpath:sidecar_refused_requests",
            "Requests a side-car refused for a missing or wrong token",
            labels=["node"],
        )
        for n in nodes:
            pending.add_metric([str(n["node"])], n.get("unfinished_writes", 0))
            refused.add_metric([str(n["node"])], n.get("refused_requests", 0))
        # each block named in its side-car's log
        yield persist_failed_family(sum(n.get("failed_writes", 0) for n in nodes))
        yield pending
        yield refused
        settle = CounterMetricFamily(
            "dualpath:settle_waits_failed",
            "Waits for a prefix's writes that did not end in a clear answer",
            labels=["reason"],
        )
        settle.add_metric(["sidecar_error"], st.settle_failures)
        settle.add_metric(["timeout"], st.settle_timeouts)
        yield settle
