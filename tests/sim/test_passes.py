"""Layer pipelining: the aggregated pass equals an explicit per-layer simulation (design §8)."""

from __future__ import annotations

import pytest

from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.passes import AggregatePass, PassPlan, PerLayerPass
from dualpath.sim.pipeline import flow_shop_s, layerwise_pass_s, serial_pass_s
from dualpath.sim.transfers import Transfers

GB = 1e9


def _run(plan_args: dict[str, float], num_layers: int, mode: str) -> float:
    """End time of one pass on isolated resources: loads on ``load``, sends on ``send``,
    the collective on ``coll`` (each 1 GB/s unless stated)."""
    loop = EventLoop()
    net = FluidNetwork(loop, traffic_manager=True)
    load_r = net.add_resource("load", 1 * GB)
    send_r = net.add_resource("send", 2 * GB)
    coll_r = net.add_resource("coll", 4 * GB)
    transfers = Transfers(loop, net, oracle=False)
    plan = PassPlan(compute_s=plan_args["compute_s"])
    if plan_args.get("load_bytes"):
        plan.loads = [("de_buffer_to_pe_hbm", (load_r,), plan_args["load_bytes"])]
    if plan_args.get("send_bytes"):
        plan.sends = [("pe_hbm_to_de_buffer", (send_r,), plan_args["send_bytes"])]
    if plan_args.get("coll_bytes"):
        plan.collective = ("collectives", (coll_r,), plan_args["coll_bytes"])
    end: list[float] = []

    def done() -> None:
        end.append(loop.now)

    if mode == "per_layer":
        PerLayerPass(loop, transfers, num_layers, plan, done).start()
    else:
        AggregatePass(loop, transfers, num_layers, plan, mode == "layerwise", done).start()
    loop.run()
    assert len(end) == 1
    return end[0]


CASES = [
    # compute-bound: 2 s compute, 1 s load, 0.5 s send
    {"compute_s": 2.0, "load_bytes": 1 * GB, "send_bytes": 1 * GB},
    # load-bound: 4 s of loads
    {"compute_s": 1.0, "load_bytes": 4 * GB, "send_bytes": 0.2 * GB},
    # send-bound: 3 s of sends
    {"compute_s": 0.5, "load_bytes": 0.1 * GB, "send_bytes": 6 * GB},
    # the collective outlasts compute (2.5 s vs 1 s)
    {"compute_s": 1.0, "load_bytes": 1 * GB, "send_bytes": 1 * GB, "coll_bytes": 10 * GB},
    # nothing to load (no hits)
    {"compute_s": 1.0, "send_bytes": 1 * GB},
]


@pytest.mark.parametrize("num_layers", [1, 3, 61])
@pytest.mark.parametrize("case", CASES)
def test_aggregate_equals_per_layer(case: dict[str, float], num_layers: int) -> None:
    aggregate = _run(case, num_layers, "layerwise")
    explicit = _run(case, num_layers, "per_layer")
    assert aggregate == pytest.approx(explicit, rel=1e-9)
    stages = (
        case.get("load_bytes", 0.0) / GB,
        max(case["compute_s"], case.get("coll_bytes", 0.0) / (4 * GB)),
        case.get("send_bytes", 0.0) / (2 * GB),
    )
    assert aggregate == pytest.approx(layerwise_pass_s(num_layers, *stages), rel=1e-9)


def test_two_stage_closed_form() -> None:
    # L·max(c, t) + min(c, t) for per-layer compute c and transfer t
    c, t, layers = 0.02, 0.05, 61
    assert flow_shop_s(layers, c * layers, t * layers) == pytest.approx(
        layers * max(c, t) + min(c, t)
    )
    assert _run({"compute_s": c * layers, "load_bytes": t * layers * GB}, layers, "layerwise") == (
        pytest.approx(layers * max(c, t) + min(c, t))
    )


def test_serial_pass_loads_before_compute() -> None:
    # Basic (classic path): 3 s of loads, then 2 s of compute, then 1 s of sends, in series
    case = {"compute_s": 2.0, "load_bytes": 3 * GB, "send_bytes": 2 * GB}
    end = _run(case, 4, "serial")
    assert end == pytest.approx(3.0 + 2.0 + 1.0)
    assert end == pytest.approx(serial_pass_s(4, 3.0, 2.0, 1.0))
    # the collective (2.5 s) outlasts compute: sends start after it
    coll = {**case, "coll_bytes": 10 * GB}
    assert _run(coll, 4, "serial") == pytest.approx(3.0 + 2.5 + 1.0)
    assert end > _run(case, 4, "layerwise")  # layerwise overlaps the loads


def test_flow_shop_rejects_zero_layers() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        flow_shop_s(0, 1.0)


def test_whole_simulation_per_layer_matches_aggregate() -> None:
    # End to end, with contention (I/O-bound DS 27B): per-layer flows vs aggregated passes.
    from dualpath.config.sim import SimConfig
    from dualpath.sim.runner import simulate

    from .conftest import small_config

    config = small_config("ds27b-1p1d", 8, "32k", "hardware.snic_bytes_per_s=2e9")
    agg = simulate(config, "dualpath", SimConfig(per_layer=False))
    explicit = simulate(config, "dualpath", SimConfig(per_layer=True))
    assert explicit.num_turns == agg.num_turns
    assert explicit.jct_s == pytest.approx(agg.jct_s, rel=0.02)
    ttft = [r.summary["ttft_s"]["mean"] for r in (agg, explicit)]
    assert ttft[1] == pytest.approx(ttft[0], rel=0.03)

    def read(r: object) -> float:
        b = r.path_bytes  # type: ignore[attr-defined]
        return float(b["storage_to_pe_buffer"] + b["storage_to_de_buffer"])

    assert read(explicit) == pytest.approx(read(agg), rel=1e-12)  # same hits, sides may differ
