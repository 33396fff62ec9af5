"""Emulated GPU time: a pass ends no earlier than the cost model's time; tokens unchanged."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.config import preset
from dualpath.models import calibrate, cost
from dualpath.runtime.gputime import GpuTime, GpuUse, LayerFloor
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.session import Runtime
from dualpath.workload.scripts import agent_scripts, small_trajectories

from .conftest import assert_no_processes, reference_outputs, small_config


class FakeClock:
    def __init__(self) -> None:
        self.t = 10.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def test_layer_floor_holds_each_layer_after_its_load_and_excludes_waits() -> None:
    clock = FakeClock()
    floor = LayerFloor(0.4, 4, clock.now, clock.sleep)  # 0.1 s per layer
    clock.t += 0.03  # layer 0 computes 0.03 s
    floor.layer_done()
    assert clock.t == pytest.approx(10.1)  # held to its emulated 0.1 s
    clock.t += 0.05  # layer 1: blocked 0.05 s on its loads, then 0.02 s of compute
    floor.waited(0.05)
    clock.t += 0.02
    floor.layer_done()
    assert clock.t == pytest.approx(10.25)  # the load delays the layer; compute still 0.1 s
    clock.t += 0.3  # layer 2 overruns: the host is slower than the emulated GPU
    floor.layer_done()
    assert clock.t == pytest.approx(10.55)
    clock.t += 0.2  # the group's collective after layer 2: not compute
    floor.restart()
    floor.layer_done()  # layer 3: no compute at all, still 0.1 s
    assert clock.t == pytest.approx(10.85)
    assert clock.t - 10.0 >= 0.4  # never earlier than the emulated pass
    assert floor.host_s == pytest.approx(0.03 + 0.02 + 0.3)  # waits and collectives excluded


def test_host_time_never_waits_but_measures() -> None:
    clock = FakeClock()
    floor = LayerFloor(None, 2, clock.now, clock.sleep)
    clock.t += 0.01
    floor.layer_done()
    clock.t += 0.02
    floor.layer_done()
    assert clock.slept == [] and floor.host_s == pytest.approx(0.03)


def test_gpu_use_counts_overruns() -> None:
    use = GpuUse()
    assert use.overrun_share != use.overrun_share  # NaN before any pass
    use.add(0.1, 0.05)
    use.add(0.1, 0.2)
    assert (use.passes, use.overran) == (2, 1) and use.overrun_share == 0.5
    assert use.emulated_s == pytest.approx(0.2) and use.host_s == pytest.approx(0.25)


def test_emulated_times_are_the_simulator_charges() -> None:
    cfg = preset("tiny-1p1d")
    m, hw = cfg.model, cfg.hardware
    one = GpuTime(m, hw, 1, 1)
    sample = calibrate.PrefillSample(512, 64, 0.0, 3)
    assert one.prefill_s(sample.pairs, 3 * 64) == pytest.approx(
        calibrate.predicted_prefill_s(m, hw, sample), rel=1e-12
    )
    assert one.decode_s(4, 4 * 900) == cost.decode_step_time_s(m, hw, 4, 3600, 1)
    two = GpuTime(m, hw, 2, 1)  # a group of two: the GEMMs of both PEs' tokens split evenly
    want = (
        cost.prefill_fixed_s(m, hw, 2)
        + cost.prefill_linear_time_s(m, hw, 100 / 2, 2)
        + cost.attention_time_s(m, hw, [(0, 60)])
    )
    assert two.prefill_s([(0, 60)], 100) == pytest.approx(want, rel=1e-12)


def test_gpu_time_option_is_checked() -> None:
    with pytest.raises(ValueError, match="gpu_time='gpu' is invalid: must be one of emulated"):
        RuntimeOptions(gpu_time="gpu")


@pytest.mark.slow
@pytest.mark.runtime
def test_passes_end_no_earlier_than_emulated_and_tokens_match_host_time(tmp_path: Path) -> None:
    """One PE, one DE, one request per pass and per decode batch (so every turn's prefill is
    one pass and every step one request): on an emulated GPU far slower than this host, each
    turn's prefill lasts at least its pass's emulated time and its decode at least its steps';
    the tokens are the host-time run's and the recompute reference's."""
    cfg = small_config()
    slow = replace(cfg.hardware, gpu_bf16_flops=4e9, gpu_fp8_flops=4e9, hbm_bytes_per_s=1e9)
    cfg = replace(cfg, hardware=slow)
    wl = replace(cfg.workload, num_agents=2, seed=3)
    trajs = small_trajectories(wl, 64, num_turns=2, token_scale=0.1, max_gen_tokens=3)
    agents = agent_scripts(trajs, cfg.model.vocab_size, 3)
    want = reference_outputs(cfg, agents)
    results = {}
    for mode in ("host", "emulated"):
        opts = RuntimeOptions(
            system="basic", kv_root=str(tmp_path / mode), batching=False, gpu_time=mode
        )
        fresh = [AgentState(a.agent_id, a.appends, a.outputs) for a in agents]
        with Runtime(cfg, opts) as rt:
            results[mode] = rt.run(fresh)
            pids = rt.pids()
        assert_no_processes(pids)
    host, emu = results["host"], results["emulated"]
    assert host.outputs == emu.outputs == want
    assert host.gpu_use == {}  # host time: nothing emulated, nothing counted
    assert set(emu.gpu_use) == {"pe0@node0", "de1@node1"}
    gpu = GpuTime(cfg.model, slow, 1, 1)
    for r in emu.records:
        new = r.prompt_tokens - r.hit_tokens
        prefill_s = gpu.prefill_s([(r.hit_tokens, new)], new)
        assert prefill_s > 0.05  # the floor is what binds here, not the host
        assert r.first_token_s - r.prefill_start_s >= prefill_s
        steps = sum(gpu.decode_s(1, r.prompt_tokens + 1 + j) for j in range(r.output_tokens - 1))
        assert r.finish_s - r.first_token_s >= steps
    pe = emu.gpu_use["pe0@node0"]
    assert pe.passes == len(emu.records)  # one pass per turn
    new_tokens = [r.prompt_tokens - r.hit_tokens for r in emu.records]
    emulated = [
        gpu.prefill_s([(r.hit_tokens, n)], n) for r, n in zip(emu.records, new_tokens, strict=True)
    ]
    assert pe.emulated_s == pytest.approx(sum(emulated))
    assert emu.gpu_use["de1@node1"].passes == sum(r.output_tokens - 1 for r in emu.records)
