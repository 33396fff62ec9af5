"""Capacity search on toy systems whose answer is known."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.metrics.capacity import CapacityResult, find_capacity


def threshold(limit_aps: float) -> Callable[[float], bool]:
    return lambda aps: aps <= limit_aps


def assert_consistent(result: CapacityResult) -> None:
    """Every passing probe is ≤ capacity, every failing one ≥ the upper bound; none repeats."""
    assert all(p.aps <= result.capacity_aps for p in result.probes if p.passed)
    assert all(p.aps >= result.upper_aps for p in result.probes if not p.passed)
    assert len({p.aps for p in result.probes}) == len(result.probes)


def test_step_toy_expands_hi_and_brackets_the_answer() -> None:
    result = find_capacity(threshold(3.7), lo_aps=1.0, hi_aps=2.0)
    assert result.converged
    assert result.capacity_aps <= 3.7 < result.upper_aps
    assert result.capacity_aps == pytest.approx(3.7, rel=0.05)
    assert result.upper_aps - result.capacity_aps <= 0.05 * result.capacity_aps
    # 1 and 2 pass, 4 fails, then bisection of [2, 4]
    assert [p.aps for p in result.probes[:3]] == [1.0, 2.0, 4.0]
    assert_consistent(result)


def test_step_toy_shrinks_lo_when_it_fails() -> None:
    result = find_capacity(threshold(0.3), lo_aps=1.0, hi_aps=2.0, rel_tol=0.01)
    assert [p.aps for p in result.probes[:3]] == [1.0, 0.5, 0.25]
    assert result.converged and result.capacity_aps == pytest.approx(0.3, rel=0.01)
    assert_consistent(result)


def test_never_passing_gives_zero_and_stops_at_max_iter() -> None:
    result = find_capacity(lambda aps: False, 1.0, 2.0, max_iter=6)
    assert result.capacity_aps == 0.0 and not result.converged
    assert result.num_probes == 6
    assert result.upper_aps == pytest.approx(1.0 / 2**5)


def test_always_passing_reports_unbounded() -> None:
    result = find_capacity(lambda aps: True, 1.0, 2.0, max_iter=5)
    assert not result.converged and math.isinf(result.upper_aps)
    assert result.capacity_aps == 16.0  # probes 1, 2, 4, 8, 16
    assert result.to_dict()["upper_aps"] is None


def test_deterministic_and_json_safe() -> None:
    a = find_capacity(threshold(5.55), 1.0, 3.0)
    b = find_capacity(threshold(5.55), 1.0, 3.0)
    assert a == b
    assert a.to_dict()["probes"][0] == {"aps": 1.0, "passed": True}  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lo_aps": 0.0, "hi_aps": 1.0}, "lo_aps"),
        ({"lo_aps": 2.0, "hi_aps": 1.0}, "hi_aps"),
        ({"lo_aps": 1.0, "hi_aps": 2.0, "rel_tol": 0.0}, "rel_tol"),
        ({"lo_aps": 1.0, "hi_aps": 2.0, "max_iter": 1}, "max_iter"),
    ],
)
def test_bad_arguments(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        find_capacity(threshold(1.0), **kwargs)  # type: ignore[arg-type]


def test_mm1_analytic_capacity() -> None:
    """M/M/1 with service rate mu: mean sojourn 1/(mu - λ) ≤ T ⇔ λ ≤ mu - 1/T (= 8 here)."""
    mu, target_s = 10.0, 0.5

    def passes(aps: float) -> bool:
        return aps < mu and 1.0 / (mu - aps) <= target_s

    result = find_capacity(passes, 1.0, 2.0, rel_tol=0.01)
    assert result.converged
    assert result.capacity_aps == pytest.approx(mu - 1 / target_s, rel=0.01)


def test_mm1_simulated_with_common_random_numbers() -> None:
    """A seeded M/M/1 simulation (Lindley recursion) at every probe reuses the same random
    numbers, arrivals scaled by 1/λ, so mean sojourn is monotone in λ and the search
    finds the analytic answer mu - 1/T = 0.5 within simulation error."""
    mu, target_s, num_customers = 1.0, 2.0, 40_000
    rng = random.Random(7)
    gaps = [rng.expovariate(1.0) for _ in range(num_customers)]
    services = [rng.expovariate(mu) for _ in range(num_customers)]

    def mean_sojourn_s(aps: float) -> float:
        wait, total = 0.0, 0.0
        for gap, service in zip(gaps, services, strict=True):
            wait = max(0.0, wait - gap / aps)
            total += wait + service
            wait += service
        return total / num_customers

    result = find_capacity(lambda aps: mean_sojourn_s(aps) <= target_s, 0.1, 0.2, rel_tol=0.02)
    assert result.converged
    assert result.capacity_aps == pytest.approx(mu - 1 / target_s, rel=0.1)
    assert_consistent(result)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.floats(min_value=0.01, max_value=1000.0),
    lo=st.floats(min_value=0.05, max_value=50.0),
    span=st.floats(min_value=1.01, max_value=20.0),
    rel_tol=st.sampled_from([0.01, 0.05, 0.2]),
)
def test_property_brackets_any_threshold(
    limit: float, lo: float, span: float, rel_tol: float
) -> None:
    result = find_capacity(threshold(limit), lo, lo * span, rel_tol=rel_tol, max_iter=80)
    assert result.converged
    assert result.capacity_aps <= limit < result.upper_aps
    assert result.upper_aps - result.capacity_aps <= rel_tol * result.capacity_aps
    assert_consistent(result)
