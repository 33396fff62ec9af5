"""Steady state of an online run and the storage bound on capacity."""

from __future__ import annotations

import math

import pytest

from dualpath.metrics.steady import STEADY_COVERAGE, StorageBound, read_warmup_s


def test_read_warmup_by_hand() -> None:
    # agent A: turns of 10 s; it reads 100 B at age 10 s and 300 B at age 20 s.
    # agent B: turns of 5 s; it reads 600 B at age 5 s. Reads sorted by age: 600 B at 5 s,
    # 100 B at 10 s, 300 B at 20 s, of 1000 B: the expected read rate of Poisson arrivals
    # from t = 0 is at 60% of its steady value from 5 s, 70% from 10 s, 100% from 20 s.
    agents = [[(10.0, 0.0), (10.0, 100.0), (10.0, 300.0)], [(5.0, 0.0), (5.0, 600.0)]]
    assert read_warmup_s(agents, 0.6) == 5.0
    assert read_warmup_s(agents, 0.65) == 10.0
    assert read_warmup_s(agents, 0.7) == 10.0
    assert read_warmup_s(agents, STEADY_COVERAGE) == 20.0
    assert read_warmup_s([[(3.0, 0.0)]], 0.95) == 0.0  # nothing read
    with pytest.raises(ValueError, match="coverage"):
        read_warmup_s(agents, 0.0)


def test_storage_bound_by_hand() -> None:
    # 2 prefill SNICs of 50 GB/s, 200 GB of hits per agent: 0.5 agents per second at most
    bound = StorageBound(200e9, 2 * 50e9)
    assert bound.aps == pytest.approx(0.5)
    bound.check(0.5, "x")  # at the bound is fine
    with pytest.raises(ValueError, match=r"x: capacity 0.69 APS exceeds the storage bound 0.5"):
        bound.check(0.69, "x")
    assert math.isinf(StorageBound(200e9, math.inf).aps)  # the Oracle's free reads
    assert math.isinf(StorageBound(0.0, 1e9).aps)
