"""Results of one simulated system: JCT, utilisation, bytes per path, read sides, counters.

Pure read-out of a finished ``Cluster``; the JSON form (``to_dict``) is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dualpath.metrics import TurnRecord, summarize
from dualpath.sim.cluster import Cluster
from dualpath.types import EngineKind, KVPath, TrafficClass

RESOURCE_CLASSES = (
    "pe_snic_read",
    "de_snic_read",
    "pe_snic_write",
    "de_snic_write",
    "pe_cnic_tx",
    "pe_cnic_rx",
    "de_cnic_tx",
    "de_cnic_rx",
    "pe_dram",
    "de_dram",
    "pe_gpu",
    "de_gpu",
)


@dataclass(frozen=True, slots=True)
class SimResult:
    """One system's outcome. ``utilisation[class]`` = {"mean", "max"} over the resources of
    that class of bytes carried / (capacity × JCT) (GPUs: busy time / JCT).
    ``cnic_class_bytes[class]`` = {"high", "low"}: bytes the CNICs of that class carried per
    traffic class (HIGH: MoE collectives, LOW: KV), summed over the resources."""

    system: str
    jct_s: float
    num_turns: int
    summary: dict[str, Any]
    utilisation: dict[str, dict[str, float]]
    path_bytes: dict[str, float]
    read_side_shares: dict[str, float]
    counters: dict[str, Any]
    records: tuple[TurnRecord, ...] = field(repr=False, default=())
    cnic_class_bytes: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe and deterministic (records excluded)."""
        return {
            "system": self.system,
            "jct_s": self.jct_s,
            "num_turns": self.num_turns,
            "summary": self.summary,
            "utilisation": self.utilisation,
            "path_bytes": self.path_bytes,
            "read_side_shares": self.read_side_shares,
            "counters": self.counters,
            "cnic_class_bytes": self.cnic_class_bytes,
        }


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "max": 0.0}
    return {"mean": sum(values) / len(values), "max": max(values)}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def utilisation(cluster: Cluster, jct_s: float) -> dict[str, dict[str, float]]:
    topo, fabric, net = cluster.topo, cluster.fabric, cluster.net
    span = jct_s if jct_s > 0 else 1.0
    groups: dict[str, list[float]] = {name: [] for name in RESOURCE_CLASSES}

    def load(rid: int) -> float:
        return net.bytes_carried(rid) / (net.capacity(rid) * span)

    for n in range(topo.num_nodes):
        k = "pe" if topo.kind_of_node(n) is EngineKind.PE else "de"
        groups[f"{k}_snic_read"].append(load(fabric.snic_read[n]))
        groups[f"{k}_snic_write"].append(load(fabric.snic_write[n]))
        groups[f"{k}_dram"].append(load(fabric.dram[n]))
    for e in topo.engine_ids:
        k = "pe" if topo.is_pe(e) else "de"
        groups[f"{k}_cnic_tx"].append(load(fabric.tx[e]))
        groups[f"{k}_cnic_rx"].append(load(fabric.rx[e]))
    for pg in cluster.prefill_groups:
        groups["pe_gpu"].extend(pg.busy_s[pe] / span for pe in pg.members)
    for dg in cluster.decode_groups:
        groups["de_gpu"].extend(b / span for b in dg.busy_s)
    return {name: _stats(groups[name]) for name in RESOURCE_CLASSES}


def cnic_class_bytes(cluster: Cluster) -> dict[str, dict[str, float]]:
    """Bytes per traffic class over the CNICs of each kind and direction."""
    topo, fabric, net = cluster.topo, cluster.fabric, cluster.net
    out: dict[str, dict[str, float]] = {}
    for kind, engines in (("pe", topo.pe_ids), ("de", topo.de_ids)):
        for direction, rids in (("tx", fabric.tx), ("rx", fabric.rx)):
            out[f"{kind}_cnic_{direction}"] = {
                klass.name.lower(): sum(net.bytes_carried_by_class(rids[e], klass) for e in engines)
                for klass in TrafficClass
            }
    return out


def collect(cluster: Cluster) -> SimResult:
    """Read out a cluster whose every turn finished."""
    records = tuple(sorted(cluster.records, key=lambda r: r.request_id))
    summary = summarize(records, "offline")
    jct = summary.jct_s
    sides: dict[str, int] = {}
    for r in records:
        sides[r.read_side] = sides.get(r.read_side, 0) + 1
    shares = {side: sides[side] / len(records) for side in sorted(sides)}
    counters = {
        "events": cluster.loop.num_processed,
        "event_digest": cluster.loop.log_digest(),
        "flows": cluster.transfers.num_flows,
        "pulls": cluster.num_pulls,
        "prefill_passes": sum(g.num_passes for g in cluster.prefill_groups),
        "decode_steps": sum(g.num_steps for g in cluster.decode_groups),
        "collective_slowdown": _ratio(
            sum(g.collective_s for g in cluster.prefill_groups),
            sum(g.collective_ideal_s for g in cluster.prefill_groups),
        ),
        "bytes_read": cluster.core.bytes_read,
        "pe_buffer_peak_bytes": max(
            (
                n.buffer_peak_bytes
                for n in cluster.node_ios
                if n.path_kind is KVPath.STORAGE_TO_PE_BUFFER
            ),
            default=0.0,
        ),
        "de_buffer_peak_bytes": max(
            (
                n.buffer_peak_bytes
                for n in cluster.node_ios
                if n.path_kind is KVPath.STORAGE_TO_DE_BUFFER
            ),
            default=0.0,
        ),
    }
    held = cluster.residency
    if held is not None:  # a reuse design (docs/peers.md): how much it found, and lost
        counters.update(
            reused_tokens=held.reused_tokens,
            recomputed_tokens=held.recomputed_tokens,
            held_tokens_at_end=held.held_tokens(),
            evicted_tokens=held.evicted_tokens(),
            expired_tokens=held.expired_tokens(),
        )
    return SimResult(
        system=cluster.system.name,
        jct_s=jct,
        num_turns=len(records),
        summary=summary.to_dict(),
        utilisation=utilisation(cluster, jct),
        path_bytes=cluster.transfers.path_bytes(),  # the core's RunCounters, + collectives
        read_side_shares=shares,
        counters=counters,
        records=records,
        cnic_class_bytes=cnic_class_bytes(cluster),
    )
