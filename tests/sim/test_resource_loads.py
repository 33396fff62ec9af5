"""Traffic accounting against design §5: with every SNIC saturated, each resource carries the
load ``dualpath.models.planner.resource_loads`` derives (relative to the SNIC read rate)."""

from __future__ import annotations

import pytest

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.models.planner import resource_loads
from dualpath.sim.cluster import Cluster
from dualpath.sim.runner import build_cluster
from dualpath.types import EngineKind
from dualpath.workload import Trajectory, TrajectoryTurn

# planner name → (node kind, resource attribute of Topology)
MAPPING = {
    "PE SNIC read": ("pe", "snic_read"),
    "DE SNIC read": ("de", "snic_read"),
    "PE CNIC read": ("pe", "tx"),
    "PE CNIC write": ("pe", "rx"),
    "DE CNIC read": ("de", "tx"),
    "DE CNIC write": ("de", "rx"),
    "PE DRAM": ("pe", "dram"),
    "DE DRAM": ("de", "dram"),
}


def _snapshot(cluster: Cluster) -> dict[str, float]:
    """Mean bytes carried per resource of each planner class, up to now."""
    topo, net = cluster.topo, cluster.net
    out: dict[str, float] = {}
    for name, (kind, attr) in MAPPING.items():
        ids: list[int] = []
        if attr in ("tx", "rx"):
            engines = topo.pe_ids if kind == "pe" else topo.de_ids
            ids = [getattr(cluster.fabric, attr)[e] for e in engines]
        else:
            want = EngineKind.PE if kind == "pe" else EngineKind.DE
            nodes = [n for n in range(topo.num_nodes) if topo.kind_of_node(n) is want]
            ids = [getattr(cluster.fabric, attr)[n] for n in nodes]
        out[name] = sum(net.bytes_carried(r) for r in ids) / len(ids)
    return out


def _run_until(cluster: Cluster, turns: int) -> None:
    cluster.loop.run(stop=lambda: cluster.num_turns_done >= turns)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 4)])
def test_steady_state_loads_match_planner(shape: tuple[int, int]) -> None:
    p, d = shape
    config = apply_overrides(
        preset("ds27b-1p1d"),
        [f"cluster.num_prefill_nodes={p}", f"cluster.num_decode_nodes={d}"],
    )
    # I/O-bound turns: ~20K hit tokens, 1 appended token, 2 generated (one decode step)
    trajs = [
        Trajectory(a, (TrajectoryTurn(20_000 + 64 * (a % 7), 2), *[TrajectoryTurn(1, 2)] * 12))
        for a in range(96)
    ]
    sim = SimConfig(collectives=False)
    cluster = build_cluster(config, "dualpath", sim, trajectories=trajs)
    total = cluster.num_turns_total
    _run_until(cluster, total // 4)  # past every agent's first (compute-heavy) turn
    t1, before = cluster.loop.now, _snapshot(cluster)
    _run_until(cluster, total * 3 // 4)
    t2, after = cluster.loop.now, _snapshot(cluster)
    rate = {k: (after[k] - before[k]) / (t2 - t1) for k in MAPPING}

    planned = {r.resource: r for r in resource_loads(config, p, d)}
    sb = config.hardware.snic_total_bytes_per_s
    # all SNICs busy, evenly: the setting the planner's figures assume
    assert rate["PE SNIC read"] > 0.97 * sb
    assert rate["DE SNIC read"] > 0.97 * sb
    snic = (rate["PE SNIC read"] * p + rate["DE SNIC read"] * d) / (p + d)
    for name in MAPPING:
        expected = planned[name].load_bytes_per_s / sb  # in units of one SNIC's read rate
        assert rate[name] / snic == pytest.approx(expected, rel=0.03), name
