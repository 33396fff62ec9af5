"""SLO check and the online stop rule (design §9) on hand-built turn records."""

from __future__ import annotations

import math

import pytest

from dualpath.metrics.record import TurnRecord
from dualpath.metrics.slo import SLO, StopReason, StopRule, check_slo, first_stop, statistic


def rec(
    request_id: int,
    arrival_s: float,
    ttft_s: float,
    tpot_s: float = 0.02,
    output_tokens: int = 12,
) -> TurnRecord:
    """A turn arriving at arrival_s, first token ttft_s later, second token 0.01 s after it,
    then (output_tokens - 2) tokens at tpot_s each."""
    first = arrival_s + ttft_s
    second = first + 0.01
    return TurnRecord(
        agent_id=request_id % 3,
        turn_index=request_id,
        request_id=request_id,
        arrival_s=arrival_s,
        scheduled_s=arrival_s,
        read_start_s=arrival_s,
        read_done_s=arrival_s,
        prefill_start_s=arrival_s,
        first_token_s=first,
        second_token_s=second,
        finish_s=second + tpot_s * (output_tokens - 2),
        prompt_tokens=100,
        hit_tokens=64,
        output_tokens=output_tokens,
        read_side="pe",
    )


def test_slo_defaults_and_validation() -> None:
    assert SLO() == SLO(ttft_s=4.0, tpot_s=0.050)
    with pytest.raises(ValueError, match=r"SLO\.ttft_s=0"):
        SLO(ttft_s=0)
    with pytest.raises(ValueError, match=r"SLO\.tpot_s=nan"):
        SLO(tpot_s=math.nan)


def test_statistic_mean_and_nearest_rank() -> None:
    values = [1.0, 2.0, 3.0, 10.0]
    assert statistic(values, None) == 4.0
    assert statistic(values, 50) == 2.0
    assert statistic(values, 90) == 10.0
    assert math.isnan(statistic([], None))
    with pytest.raises(ValueError, match="quantile=101"):
        statistic(values, 101)


def test_check_slo_mean_passes_where_p90_fails() -> None:
    # nine fast turns and one at 13 s: mean TTFT = (9·2 + 13)/10 = 3.1 s, p90 = 2 s, p100 = 13 s
    records = [rec(i, float(i), 2.0) for i in range(9)] + [rec(9, 9.0, 13.0)]
    mean = check_slo(records)
    assert mean.passed and mean.ttft_s == pytest.approx(3.1)
    assert mean.tpot_s == pytest.approx(0.02)
    assert check_slo(records, quantile=90).ttft_s == pytest.approx(2.0)
    strict = check_slo(records, quantile=100)
    assert not strict.passed and not strict.ttft_ok and strict.tpot_ok


def test_check_slo_tpot_breaks_and_undefined_tpot_passes() -> None:
    slow = check_slo([rec(0, 0.0, 1.0, tpot_s=0.06)])
    assert not slow.passed and slow.ttft_ok and not slow.tpot_ok
    two_tokens = check_slo([rec(0, 0.0, 1.0, output_tokens=2)])
    assert two_tokens.passed and math.isnan(two_tokens.tpot_s)
    with pytest.raises(ValueError, match="no turn records"):
        check_slo([])


def test_stop_rule_breaks_on_ttft_in_recent_window() -> None:
    rule = StopRule(window_s=10.0, lookback_s=100.0)
    # turn i: TTFT 1 + i s, finishes at 2i + 1.21 s (0.01 s to token 2, 10 tokens × 0.02 s)
    reasons = [rule.observe(rec(i, float(i), 1.0 + i)) for i in range(12)]
    # window (now-10, now] mean first exceeds 4 s at the turn whose ttft makes the mean > 4
    stop_index = next(i for i, r in enumerate(reasons) if r is not None)
    assert reasons[stop_index] is StopReason.TTFT_OVER_SLO
    assert reasons[stop_index].is_slo_break
    # at turn k ≥ 4 the 10 s window holds turns k-4..k: mean TTFT = k - 1, first > 4 at k = 6
    assert stop_index == 6
    assert all(r is StopReason.TTFT_OVER_SLO for r in reasons[stop_index:])  # latches
    assert rule.stopped_at_s == pytest.approx(2 * 6 + 1.21)


def test_stop_rule_tpot_break() -> None:
    rule = StopRule(window_s=10.0, lookback_s=100.0)
    assert rule.observe(rec(0, 0.0, 1.0, tpot_s=0.04)) is None
    assert rule.observe(rec(1, 1.0, 1.0, tpot_s=0.07)) is StopReason.TPOT_OVER_SLO


def test_stop_rule_min_samples_ignores_a_lone_outlier() -> None:
    rule = StopRule(window_s=10.0, lookback_s=100.0, quantile=50, min_samples=3)
    assert rule.observe(rec(0, 0.0, 9.0)) is None  # one sample: below min_samples
    assert rule.observe(rec(1, 9.0, 0.5)) is None
    assert rule.observe(rec(2, 9.5, 0.5)) is None  # median of {9, 0.5, 0.5} = 0.5


def test_stop_rule_steady_state_after_lookback() -> None:
    rule = StopRule(window_s=10.0, lookback_s=50.0, rel_tol=0.05)
    reason = None
    t = 0.0
    i = 0
    while reason is None and t < 200:
        reason = rule.observe(rec(i, t, 2.0), now_s=t + 2.0)
        t += 1.0
        i += 1
    assert reason is StopReason.STEADY_STATE
    # constant TTFT: steady as soon as now ≥ first arrival + lookback + window = 60 s
    assert rule.stopped_at_s == pytest.approx(60.0)


def test_stop_rule_no_steady_state_before_the_warmup() -> None:
    # same constant TTFT, warm-up 100 s: both compared windows must lie after it, so steady
    # state comes at 100 + 50 + 10 = 160 s, not at 60 s
    rule = StopRule(window_s=10.0, lookback_s=50.0, rel_tol=0.05, warmup_s=100.0)
    reason, t, i = None, 0.0, 0
    while reason is None and t < 300:
        reason = rule.observe(rec(i, t, 2.0), now_s=t + 2.0)
        t, i = t + 1.0, i + 1
    assert reason is StopReason.STEADY_STATE
    assert rule.stopped_at_s == pytest.approx(160.0)
    with pytest.raises(ValueError, match=r"StopRule\.warmup_s"):
        StopRule(warmup_s=-1.0)


def test_stop_rule_no_steady_state_while_ttft_drifts() -> None:
    rule = StopRule(window_s=10.0, lookback_s=50.0, rel_tol=0.05)
    # TTFT grows 1 % per second (0.5 s → 2.2 s, under the SLO): the window 50 s earlier is
    # ~40 % lower, never within 5 %
    reasons = [rule.observe(rec(i, float(i), 0.5 * 1.01**i), now_s=i + 3.0) for i in range(150)]
    assert reasons == [None] * 150


def test_stop_rule_rejects_time_going_back_and_bad_params() -> None:
    rule = StopRule()
    rule.observe(rec(0, 0.0, 1.0), now_s=5.0)
    with pytest.raises(ValueError, match="time order"):
        rule.observe(rec(1, 0.0, 1.0), now_s=4.0)
    with pytest.raises(ValueError, match=r"StopRule\.window_s"):
        StopRule(window_s=0)
    with pytest.raises(ValueError, match=r"StopRule\.min_samples"):
        StopRule(min_samples=0)


def test_first_stop_sorts_by_finish() -> None:
    records = [rec(i, float(i), 5.0) for i in range(3)]
    rule = StopRule(window_s=10.0, lookback_s=100.0)
    assert first_stop(reversed(records), rule) is StopReason.TTFT_OVER_SLO
    assert rule.stopped_at_s == pytest.approx(records[0].finish_s)
