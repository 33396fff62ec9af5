"""Decode groups: step timing, lockstep, and macro-steps equal to step-by-step."""

from __future__ import annotations

import itertools
import random

import pytest

from dualpath.config import preset
from dualpath.config.sim import SimConfig
from dualpath.models import cost
from dualpath.sim.decode import DecodeGroup
from dualpath.sim.events import EventLoop
from dualpath.sim.request import Req
from dualpath.sim.runner import simulate
from dualpath.sim.steptime import step_time_fn

from .conftest import small_config


def _group(
    macro: int,
    members: tuple[int, ...] = (10, 11),
    h2d_bytes_per_token: float = 0.0,
    d2h_bytes_per_token: float = 0.0,
) -> tuple[EventLoop, DecodeGroup, list[Req]]:
    c = preset("ds27b-1p1d")
    loop = EventLoop()
    done: list[Req] = []
    group = DecodeGroup(
        members,
        loop=loop,
        model=c.model,
        hw=c.hardware,
        num_gpus=len(members),
        macro_steps=macro,
        on_finish=done.append,
        h2d_bytes_per_token=h2d_bytes_per_token,
        d2h_bytes_per_token=d2h_bytes_per_token,
    )
    return loop, group, done


def _req(rid: int, de: int, prompt: int, output: int) -> Req:
    r = Req(rid, rid, 0, prompt, 0, output, 0.0)
    r.de = de
    return r


@pytest.mark.parametrize("macro", [1, 4, 64])
def test_single_request_steps(macro: int) -> None:
    loop, group, done = _group(macro)
    c = preset("ds27b-1p1d")
    req = _req(0, 10, 1000, 6)
    loop.at(1.0, lambda: group.join(req))
    loop.run()
    # tokens 2..6 come from 5 decode steps; context = prompt + 1 at the first step
    steps = [cost.decode_step_time_s(c.model, c.hardware, 1, 1001 + j, 2) for j in range(5)]
    assert done == [req]
    assert req.second_token_s == pytest.approx(1.0 + steps[0], rel=1e-12)
    assert req.finish_s == pytest.approx(1.0 + sum(steps), rel=1e-12)
    assert group.num_steps == 5
    assert group.batch == [0, 0] and group.context == [0, 0] and group.generated == [0, 0]


@pytest.mark.parametrize("macro", [1, 3, 64])
def test_lockstep_slowest_de_sets_pace_and_join_waits_for_boundary(macro: int) -> None:
    loop, group, done = _group(macro)
    f = step_time_fn(preset("ds27b-1p1d").model, preset("ds27b-1p1d").hardware, 2)
    big = _req(0, 10, 100_000, 4)
    small = _req(1, 11, 100, 3)
    loop.at(0.0, lambda: group.join(big))
    join_s = f(1, 100_001) * 1.5  # mid second step
    loop.at(join_s, lambda: group.join(small))
    loop.run()
    s1 = f(1, 100_001)
    s2 = f(1, 100_002)
    # the small request joins at the end of step 2; steps 3, 4 run both DEs in lockstep
    s3 = max(f(1, 100_003), f(1, 101))
    s4 = f(1, 102)  # big finished after step 3 (3 decode steps)
    assert big.finish_s == pytest.approx(s1 + s2 + s3, rel=1e-12)
    assert small.second_token_s == pytest.approx(s1 + s2 + s3, rel=1e-12)
    assert small.finish_s == pytest.approx(s1 + s2 + s3 + s4, rel=1e-12)
    assert [r.request_id for r in done] == [0, 1]


@pytest.mark.parametrize("macro", [1, 64])
def test_kv_dma_into_and_out_of_hbm_slows_the_steps_by_hand(macro: int) -> None:
    # KV bytes per token 20,000: H2D of a 10,000-token prompt = 200 MB; D2H = 20 kB a token.
    c = preset("ds27b-1p1d")
    bw = c.hardware.hbm_bytes_per_s * c.hardware.hbm_efficiency  # 2.68e12 B/s
    loop, group, done = _group(macro, h2d_bytes_per_token=20_000, d2h_bytes_per_token=20_000)
    f = step_time_fn(c.model, c.hardware, 2)
    first = _req(0, 10, 1000, 5)
    second = _req(1, 10, 10_000, 3)
    loop.at(0.0, lambda: group.join(first))  # the group is idle: its H2D overlapped nothing
    join_s = 1.5 * f(1, 1001)  # mid second step
    loop.at(join_s, lambda: group.join(second))
    loop.run()
    d2h = 20_000 / bw  # per token generated in a step
    h2d = 10_000 * 20_000 / bw  # the second prompt's H2D: 74.6 µs
    s1 = f(1, 1001) + d2h
    s2 = f(1, 1002) + d2h
    s3 = f(2, 1003 + 10_001) + 2 * d2h + h2d  # the join's H2D is charged to this step
    s4 = f(2, 1004 + 10_002) + 2 * d2h
    assert first.finish_s == pytest.approx(s1 + s2 + s3 + s4, rel=1e-12)
    assert second.second_token_s == pytest.approx(s1 + s2 + s3, rel=1e-12)
    assert second.finish_s == pytest.approx(s1 + s2 + s3 + s4, rel=1e-12)
    assert done == [first, second]
    # charged: 6 generated tokens' D2H and one H2D, all on DE 10; DE 11 had nothing
    assert group.dma_delay_s[0] == pytest.approx(6 * d2h + h2d, rel=1e-12)
    assert group.dma_delay_s[1] == 0.0
    assert h2d == pytest.approx(74.63e-6, rel=1e-3)


def test_macro_steps_equal_step_by_step_end_to_end() -> None:
    config = small_config("ds27b-1p1d", 8, "32k")
    step = simulate(config, "dualpath", SimConfig(decode_macro_steps=1))
    macro = simulate(config, "dualpath", SimConfig(decode_macro_steps=64))
    assert macro.records == step.records
    assert macro.jct_s == step.jct_s
    assert macro.counters["decode_steps"] == step.counters["decode_steps"]
    assert macro.counters["events"] < step.counters["events"]


def test_cached_step_columns_equal_a_fresh_computation() -> None:
    """The per-member step-time columns reused across intervals give, bit for bit, the step
    end times a group with no cache computes for the same batches and contexts. Mean contexts
    stay mostly below the sparse top-k, where the step time depends on the context."""
    rng = random.Random(7)
    members = tuple(range(10, 18))
    _, group, _ = _group(64, members, d2h_bytes_per_token=20_000)
    for _ in range(300):
        for i in range(len(members)):  # a boundary: steps done, some joins / leaves
            b = group.batch[i]
            x = rng.random()
            if b and x < 0.6:  # steps only
                group.context[i] += b * rng.randrange(0, 70)
            elif b and x < 0.7:  # one leaves, one joins: same batch, another context
                group.context[i] += rng.randrange(-b, 500)
            elif x < 0.9:
                group.batch[i] = b = max(0, b + rng.choice((-1, 1, 2)))
                group.context[i] = b * rng.randrange(1, 3000) + rng.randrange(b) if b else 0
        if not any(group.batch):
            group.batch[0], group.context[0] = 1, 500
        until = rng.randrange(1, 80)
        group.times = []
        group._plan_interval(until)
        _, fresh, _ = _group(64, members, d2h_bytes_per_token=20_000)
        fresh.batch, fresh.context = list(group.batch), list(group.context)
        fresh._plan_interval(until)
        assert group.times == fresh.times
        assert len(group.times) == min(until, 64)


def test_generated_stamp_changes_whenever_the_generated_tokens_do() -> None:
    """The ledger skips a group whose stamp did not change: sampled at many instants, equal
    stamps must mean equal ``generated_by_member``, and the counts must move over the run."""
    rng = random.Random(3)
    loop, group, done = _group(8, (10, 11, 12))
    reqs = [_req(i, 10 + i % 3, rng.randrange(100, 5000), rng.randrange(1, 40)) for i in range(30)]
    for r in reqs:
        loop.at(rng.uniform(0.0, 2.0), lambda r=r: group.join(r))
    samples: list[tuple[tuple[int, int], list[int]]] = []
    for k in range(3000):
        loop.at(
            k * 0.001 + 0.0003,
            lambda: samples.append((group.generated_stamp(), list(group.generated_by_member()))),
        )
    loop.run()
    assert len(done) == 30
    for (s0, g0), (s1, g1) in itertools.pairwise(samples):
        if s0 == s1:
            assert g0 == g1
    assert len({tuple(g) for _, g in samples}) > 100
