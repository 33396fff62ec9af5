"""TTFT breakdown and load-balance series on hand-built timelines."""

from __future__ import annotations

import math

import pytest

from dualpath.metrics.breakdown import (
    TransferInterval,
    attention_balance,
    breakdown_by_aps,
    breakdown_rows,
    mean_breakdown,
    rates_from_counters,
    series_stats,
    snic_balance,
    snic_throughput,
    turn_breakdown,
)
from dualpath.metrics.record import TurnRecord


def timeline(request_id: int, *times: float) -> TurnRecord:
    """times = arrival, scheduled, read_start, read_done, prefill_start, first_token."""
    arrival, scheduled, read_start, read_done, prefill_start, first = times
    return TurnRecord(
        agent_id=0,
        turn_index=request_id,
        request_id=request_id,
        arrival_s=arrival,
        scheduled_s=scheduled,
        read_start_s=read_start,
        read_done_s=read_done,
        prefill_start_s=prefill_start,
        first_token_s=first,
        second_token_s=first + 0.05,
        finish_s=first + 0.5,
        prompt_tokens=1000,
        hit_tokens=960,
        output_tokens=10,
        read_side="de",
    )


def test_turn_breakdown_components_sum_to_ttft() -> None:
    r = timeline(0, 10.0, 10.5, 11.25, 12.0, 12.5, 13.0)
    b = turn_breakdown(r)
    assert (b.queue_s, b.alloc_s, b.read_s, b.prefill_s) == (0.5, 0.75, 0.75, 1.0)
    assert b.total_s == pytest.approx(r.ttft_s) == pytest.approx(3.0)


def test_mean_breakdown_and_by_aps() -> None:
    low = [timeline(0, 0, 0, 0, 1, 1, 2), timeline(1, 0, 0, 0, 3, 3, 4)]
    high = [timeline(2, 0, 2, 3, 4, 4.5, 5)]
    b = mean_breakdown(low)
    assert (b.queue_s, b.alloc_s, b.read_s, b.prefill_s) == (0, 0, 2, 1)
    assert b.total_s == pytest.approx((2 + 4) / 2)
    by_aps = breakdown_by_aps({2.0: high, 0.5: low})
    assert [aps for aps, _ in by_aps] == [0.5, 2.0]
    assert by_aps[1][1].queue_s == 2 and by_aps[1][1].total_s == pytest.approx(5)
    rows = breakdown_rows("DualPath", by_aps)
    assert rows[1] == {
        "system": "DualPath",
        "aps": 2.0,
        "queue_s": 2,
        "alloc_s": 1,
        "read_s": 1,
        "prefill_s": 1,
        "ttft_s": 5,
    }
    with pytest.raises(ValueError, match="no turn records"):
        mean_breakdown([])


def test_snic_throughput_spreads_bytes_over_bins() -> None:
    transfers = [
        TransferInterval(node=0, start_s=0.5, end_s=2.5, size_bytes=200.0),  # 100 B/s
        TransferInterval(node=2, start_s=1.0, end_s=1.0, size_bytes=30.0),  # instantaneous
    ]
    series = snic_throughput(transfers, nodes=[0, 1, 2], bin_s=1.0, end_s=3.0)
    assert [t for t, _ in series] == [1.0, 2.0, 3.0]
    assert [rates for _, rates in series] == [
        [50.0, 0.0, 0.0],
        [100.0, 0.0, 30.0],
        [50.0, 0.0, 0.0],
    ]
    # bytes conserved
    assert sum(sum(r) for _, r in series) * 1.0 == pytest.approx(230.0)


def test_snic_balance_windows() -> None:
    # node 0 busy at 100 B/s during [0, 2), node 1 during [2, 4): instantaneous imbalance 2.0,
    # a 4 s window sees both equally → 1.0
    transfers = [TransferInterval(0, 0.0, 2.0, 200.0), TransferInterval(1, 2.0, 4.0, 200.0)]
    short = snic_balance(transfers, [0, 1], bin_s=1.0, window_s=1.0, end_s=4.0)
    assert [v for _, v in short] == [2.0, 2.0, 2.0, 2.0]
    long = snic_balance(transfers, [0, 1], bin_s=1.0, window_s=4.0, end_s=4.0)
    assert long[-1] == (4.0, 1.0)
    assert long[2][1] == pytest.approx(200 / ((200 + 100) / 2))  # window (−1, 3]: 200 vs 100 B


def test_snic_throughput_rejects_unknown_node_and_bad_interval() -> None:
    with pytest.raises(ValueError, match=r"TransferInterval\.node=5"):
        snic_throughput([TransferInterval(5, 0.0, 1.0, 1.0)], [0, 1], 1.0, 2.0)
    with pytest.raises(ValueError, match=r"TransferInterval\.end_s"):
        TransferInterval(0, 2.0, 1.0, 1.0)


def test_rates_from_counters() -> None:
    samples = [(0.0, [0.0, 0.0]), (2.0, [100.0, 50.0]), (3.0, [100.0, 80.0])]
    assert rates_from_counters(samples) == [(2.0, [50.0, 25.0]), (3.0, [0.0, 30.0])]
    with pytest.raises(ValueError, match="counter delta"):
        rates_from_counters([(0.0, [5.0]), (1.0, [4.0])])


def test_attention_balance_per_forward() -> None:
    forwards = [(0.1, [0.2, 0.2, 0.2, 0.2]), (0.4, [0.4, 0.1, 0.1, 0.2]), (0.7, [0.0, 0.0])]
    series = attention_balance(forwards)
    assert series[0] == (0.1, 1.0)
    assert series[1][1] == pytest.approx(0.4 / 0.2)
    assert series[2] == (0.7, 1.0)
    stats = series_stats(series)
    assert stats["mean"] == pytest.approx(4 / 3) and stats["max"] == 2.0 and stats["count"] == 3
    assert math.isnan(series_stats([])["mean"])
