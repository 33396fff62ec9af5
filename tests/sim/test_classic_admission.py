"""The classic engine as built: a non-layerwise PE reads a request's hit KV
only once the request's whole prompt KV is reserved in its HBM, and frees the reservation
after the pass's send to the DE; layerwise prefill (+Layer) reads into the PE buffer ahead.

Setup, by hand: Qwen 32B on one-GPU nodes, 1P2D (one PE, two DEs). KV 262,144 B per token
(64 layers × 8 heads × 128 × 2 × 2 B); HBM 80 GB − 65.5 GB of weights − 6 GB reserve gives a
KV budget of 34,332 tokens per GPU, so one 20,000-token prompt fits and two do not. Two
agents, one turn each: 19,968 hit tokens + 32 new, one output token (the turn ends with
prefill). Read: 19,968 × 262,144 B / 50 GB/s (the SNIC alone) = 0.10469 s. Classic pass:
load the hits (0.10469 s over the loopback CNIC at 50 GB/s) → compute → send all 20,000
tokens (0.10486 s over the CNIC).
"""

from __future__ import annotations

import pytest

from dualpath.config import Config, apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.config.systems import system_spec
from dualpath.metrics import TurnRecord
from dualpath.models import cost
from dualpath.sim.admission import HbmAdmission
from dualpath.sim.cluster import Cluster
from dualpath.sim.request import Req
from dualpath.sim.runner import run_cluster
from dualpath.workload import TurnSpec

PROMPT, HIT = 20_000, 19_968
B = 50e9  # one SNIC, one CNIC (bytes/s)


def _config() -> Config:
    return apply_overrides(preset("qwen32b-1p2d"), ["hardware.gpus_per_node=1"])


def _run(system: str, *extra: str, **sim: float) -> tuple[Cluster, list[TurnRecord]]:
    config = apply_overrides(_config(), extra)
    cluster = Cluster(config, system_spec(system), SimConfig(**sim))  # type: ignore[arg-type]
    for agent in range(2):
        cluster.add_agent(agent, [TurnSpec(0, PROMPT, HIT, 1)], 0.0)
    run_cluster(cluster)
    return cluster, sorted(cluster.records, key=lambda r: r.request_id)


def _hand() -> tuple[float, float]:
    """(read time, classic pass time) from the cost model's terms."""
    config = _config()
    model, hw = config.model, config.hardware
    kv = cost.kv_bytes_per_token(model)
    assert kv == 64 * 8 * 128 * 2 * 2
    assert cost.kv_capacity_tokens(model, hw, 1) == 34_332  # one prompt fits, two do not
    read = HIT * kv / B
    compute = (
        cost.attention_time_s(model, hw, [(HIT, PROMPT - HIT)])
        + cost.prefill_linear_time_s(model, hw, PROMPT - HIT, 1)
        + cost.prefill_fixed_s(model, hw, 1)
    )
    return read, read + compute + PROMPT * kv / B


def test_basic_snic_idles_while_hbm_is_full_and_layer_does_not() -> None:
    read, classic_pass = _hand()
    assert read == pytest.approx(0.10469, abs=1e-5)
    basic, (a, b) = _run("basic")
    assert a.read_start_s == 0.0 and a.read_done_s == pytest.approx(read, rel=1e-9)
    assert a.first_token_s - a.prefill_start_s == pytest.approx(classic_pass, rel=1e-9)
    # B's read waits for A's HBM: it starts when A's pass (and its send) is over
    assert b.read_start_s == a.first_token_s
    assert b.first_token_s == pytest.approx(a.first_token_s + read + classic_pass, rel=1e-9)
    pe_node = basic.node_ios[0]
    # the SNIC idled through A's whole pass with B waiting for HBM
    assert pe_node.hbm_blocked_s == pytest.approx(classic_pass, rel=1e-9)
    assert basic.prefill_groups[0].admission[0].peak_reserved_tokens == PROMPT

    layer, (la, lb) = _run("layer")
    assert (
        layer.prefill_groups[0].kv_budget_tokens is None and not layer.prefill_groups[0].admission
    )
    assert lb.read_start_s == la.read_done_s == pytest.approx(read, rel=1e-9)  # back to back
    assert lb.read_done_s == pytest.approx(2 * read, rel=1e-9)
    assert layer.node_ios[0].hbm_blocked_s == 0.0


def test_read_ahead_lets_the_next_read_run_during_the_pass() -> None:
    read, _ = _hand()
    kv = cost.kv_bytes_per_token(_config().model)
    for sim in ({"classic_read_ahead_requests": 1}, {"classic_read_ahead_bytes": HIT * kv}):
        cluster, (a, b) = _run("basic", **sim)
        assert b.read_start_s == pytest.approx(read, rel=1e-9)  # right after A's read
        assert b.prefill_start_s == a.first_token_s  # but it joins a pass only once admitted
        assert cluster.node_ios[0].hbm_blocked_s == 0.0
    # one byte short of B's read: no read-ahead
    _, (a, b) = _run("basic", classic_read_ahead_bytes=HIT * kv - 1)
    assert b.read_start_s == a.first_token_s


def test_classic_pass_frees_the_pe_buffer_once_its_loads_land() -> None:
    # PE buffer of exactly one read, one request of read-ahead: B's read waits for A's bytes
    # to leave the buffer, i.e. for A's load into HBM (its read + load = 2 × 0.10469 s), not
    # for the end of A's pass
    read, classic_pass = _hand()
    kv = cost.kv_bytes_per_token(_config().model)
    buffer = f"hardware.pe_buffer_bytes={HIT * kv}"
    _, (a, b) = _run("basic", buffer, classic_read_ahead_requests=1)
    assert a.prefill_start_s == pytest.approx(read, rel=1e-9)
    assert b.read_start_s == pytest.approx(2 * read, rel=1e-9)  # A's load landed
    assert b.read_start_s < a.first_token_s == pytest.approx(read + classic_pass, rel=1e-9)


def test_a_prompt_larger_than_the_hbm_budget_is_refused_up_front() -> None:
    cluster = Cluster(_config(), system_spec("basic"), SimConfig())
    with pytest.raises(ValueError, match=r"prompt_tokens=40000 exceeds a PE's HBM KV budget"):
        cluster.add_agent(0, [TurnSpec(0, 1_000, 0, 5), TurnSpec(1, 40_000, 960, 1)], 0.0)
    layer = Cluster(_config(), system_spec("layer"), SimConfig())
    layer.add_agent(0, [TurnSpec(0, 40_000, 0, 1)], 0.0)  # layerwise: one layer at a time
    assert layer.num_turns_total == 1


def test_admission_is_fifo_and_frees_after_release() -> None:
    started: list[int] = []
    ready: list[int] = []
    blocked = [0]

    def req(i: int, prompt: int) -> Req:
        return Req(i, i, 0, prompt, prompt - 10, 1, 0.0)

    adm = HbmAdmission(3, 100, 0, 0.0, lambda r: ready.append(r.request_id), blocked.append)
    reqs = [req(0, 60), req(1, 30), req(2, 50), req(3, 5)]
    for r in reqs:
        adm.offer(r, 1.0, lambda i=r.request_id: started.append(i))  # type: ignore[misc]
    # 60 + 30 fit; 50 does not, and FIFO keeps the 5-token request behind it
    assert started == [0, 1] and adm.reserved_tokens == 90
    adm.read_done(reqs[1])
    assert ready == [1]
    adm.release(reqs[0])  # 30 reserved: 50 and 5 fit
    assert started == [0, 1, 2, 3] and adm.reserved_tokens == 85
    assert sum(blocked) == 0  # every request that waited has started
    with pytest.raises(ValueError, match="exceeds PE 3's HBM KV budget of 100"):
        adm.offer(req(9, 101), 1.0, None)
