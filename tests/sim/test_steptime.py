"""The decode step-time fast path: equal to the cost model, used for every preset (a silent
fallback to the slow cost model fails here), and dropped when the cost model changes."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from dualpath.config import CLUSTER_PRESETS, preset
from dualpath.models import cost
from dualpath.sim.steptime import fast_step_time, step_column_fn, step_time_fn


def _no_cost_model(*args: object, **kwargs: object) -> float:
    raise AssertionError("the fallback: the fast form was not used")


def test_the_fast_form_holds_for_every_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built for every preset, neither form calls the cost model afterwards (the fallback
    would: a stand-in that raises catches it)."""
    built = []
    for name in sorted(CLUSTER_PRESETS):
        c = preset(name)
        for gpus in (1, 8, 16, 32):
            assert fast_step_time(c.model, c.hardware, gpus) is not None, (name, gpus)
            f = step_time_fn(c.model, c.hardware, gpus)
            col = step_column_fn(c.model, c.hardware, gpus)
            built.append((name, gpus, f, col))
    monkeypatch.setattr(cost, "decode_step_time_s", _no_cost_model)
    for name, gpus, f, col in built:
        assert f(5, 5000) > 0, (name, gpus)
        assert len(col(5, 5000, 0, 3, 0.0)) == 3, (name, gpus)


def test_steptime_matches_cost_model() -> None:
    for name in ("ds660b-2p4d", "ds27b-1p1d", "qwen32b-1p2d", "tiny-1p1d"):
        c = preset(name)
        for gpus in (1, 8, 32):
            f = step_time_fn(c.model, c.hardware, gpus)
            for batch in (1, 5, 28, 64, 300):
                for mean in (0, 10, 1023, 1024, 2047, 2048, 4096, 40_000):
                    ctx = batch * mean + batch // 3 + 1
                    ref = cost.decode_step_time_s(c.model, c.hardware, batch, ctx, gpus)
                    assert f(batch, ctx) == pytest.approx(ref, rel=1e-12), (name, batch, ctx)


def test_steptime_falls_back_when_cost_model_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    c = preset("ds27b-1p1d")
    monkeypatch.setattr(cost, "decode_step_time_s", lambda model, hw, b, ctx, gpus=1: 0.125 * b)
    assert fast_step_time(c.model, c.hardware, 8) is None
    f = step_time_fn(c.model, c.hardware, 8)
    assert f(4, 4000) == 0.5  # the (changed) cost model itself, not the stale fast form
    assert step_column_fn(c.model, c.hardware, 8)(4, 4000, 0, 2, 0.25) == [0.75, 0.75]


def test_step_columns_equal_the_scalar_form_bit_for_bit() -> None:
    """A decode interval's column in one call: the fast column for every preset, and exactly
    the scalar step times (plus the D2H term) on both sides of the sparse top-k."""
    for name in sorted(CLUSTER_PRESETS):
        c = preset(name)
        for gpus in (1, 8, 32):
            f = step_time_fn(c.model, c.hardware, gpus)
            col = step_column_fn(c.model, c.hardware, gpus)  # fast: the test above
            for batch in (1, 3, 64):
                for context in (1, batch * 1000 + 7, batch * 2040, batch * 40_000 + 1):
                    got = col(batch, context, 2, 70, 1.5e-5)
                    assert got == [f(batch, context + batch * j) + 1.5e-5 for j in range(2, 70)]


def test_step_columns_across_the_memory_compute_crossover() -> None:
    """Without the indexer key cache, past the sparse top-k a memory-bound column is one
    repeated value; windows that end just past the point where compute takes over must still
    equal the scalar form. With it (the default) the steps keep growing: no repeated value."""
    c = preset("ds660b-2p4d")
    on_f, on_col = step_time_fn(c.model, c.hardware, 32), step_column_fn(c.model, c.hardware, 32)
    got = on_col(64, 64 * 5000, 0, 70, 0.0)
    assert got == [on_f(64, 64 * 5000 + 64 * j) for j in range(70)]
    assert all(b > a for a, b in itertools.pairwise(got))
    model = replace(c.model, indexer_key_cache=False)
    f = step_time_fn(model, c.hardware, 32)
    col = step_column_fn(model, c.hardware, 32)
    kinds = set()
    for batch in (64, 256):  # (a batch of one stays memory-bound at any context)
        flat = f(batch, batch * 2048)
        coarse = next(m for m in range(2048, 10**7, 97) if f(batch, batch * m) > flat)
        cross = next(m for m in range(coarse - 97, coarse + 1) if f(batch, batch * m) > flat)
        for mean in range(cross - 80, cross + 3):
            context = batch * mean + batch // 2
            got = col(batch, context, 0, 70, 2e-6)
            assert got == [f(batch, context + batch * j) + 2e-6 for j in range(70)], (batch, mean)
            kinds.add(len(set(got)) == 1)
    assert kinds == {True, False}  # both the repeated value and the step-by-step loop ran
