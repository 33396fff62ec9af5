"""summarize on hand-built timelines: JCT, percentiles, breakdown sums, shares, JSON safety."""

from __future__ import annotations

import json
import math

import pytest

from dualpath.metrics import Percentiles, TurnRecord, format_summary, percentile, summarize


def rec(req: int, agent: int, arrival: float, queue: float, read: float, out: int) -> TurnRecord:
    """A turn: queue, 0.1 s alloc, read, 0.2 s prefill, then 0.05 s per later token."""
    sched = arrival + queue
    start = sched + 0.1
    done = start + read
    first = done + 0.2
    second = first + (0.05 if out >= 2 else 0.0)
    finish = second + 0.05 * max(0, out - 2)
    return TurnRecord(
        agent,
        req,
        req,
        arrival,
        sched,
        start,
        done,
        done,
        first,
        second,
        finish,
        prompt_tokens=1000,
        hit_tokens=900,
        output_tokens=out,
        read_side="pe" if req % 2 else "de",
    )


def timeline() -> list[TurnRecord]:
    return [
        rec(0, 0, 0.0, 0.0, 1.0, 5),  # agent 0: finishes 0 + 1.3 + 0.05 + 0.15 = 1.5
        rec(1, 0, 1.5, 0.5, 1.0, 2),  # agent 0: finishes 1.5 + 1.8 + 0.05 = 3.35
        rec(2, 1, 0.0, 1.0, 0.5, 1),  # agent 1: finishes 1.8
        rec(3, 2, 2.0, 2.0, 2.0, 12),  # agent 2: finishes 2 + 4.3 + 0.05 + 0.5 = 6.85
    ]


def test_jct_and_agent_jct() -> None:
    s = summarize(timeline(), mode="offline")
    assert s.jct_s == pytest.approx(6.85)
    assert (s.num_turns, s.num_agents) == (4, 3)
    # per-agent JCTs: 3.35, 1.8, 4.85
    assert s.agent_jct.mean == pytest.approx((3.35 + 1.8 + 4.85) / 3)
    assert s.agent_jct.p50 == pytest.approx(3.35)
    assert s.agent_jct.max == pytest.approx(4.85)


def test_latency_percentiles_and_exclusions() -> None:
    s = summarize(timeline(), mode="online")
    assert s.mode == "online"
    ttfts = [1.3, 1.8, 1.8, 4.3]
    assert s.ttft.count == 4
    assert s.ttft.mean == pytest.approx(sum(ttfts) / 4)
    assert s.ttft.p50 == pytest.approx(1.8)  # nearest rank: ceil(0.5 * 4) = 2nd smallest
    assert s.ttft.p99 == pytest.approx(4.3)
    assert s.ttst.count == 3  # the one-token turn has no second token
    assert s.tpot.count == 2  # only turns with more than 2 tokens
    assert s.tpot.mean == pytest.approx(0.05)


def test_breakdown_sums_to_mean_ttft() -> None:
    s = summarize(timeline())
    b = s.breakdown
    assert b.queue_s == pytest.approx(3.5 / 4)
    assert b.alloc_s == pytest.approx(0.1)
    assert b.read_s == pytest.approx(4.5 / 4)
    assert b.prefill_s == pytest.approx(0.2)
    assert b.total_s == pytest.approx(s.ttft.mean, rel=1e-12)


def test_tokens_hits_and_read_sides() -> None:
    s = summarize(timeline())
    assert (s.prompt_tokens, s.hit_tokens, s.output_tokens) == (4000, 3600, 20)
    assert s.hit_ratio == pytest.approx(0.9)
    assert s.output_tokens_per_s == pytest.approx(20 / 6.85)
    assert s.read_side_shares == (("de", 0.5), ("pe", 0.5))


def test_to_dict_is_strict_json() -> None:
    only_one_token = [rec(0, 0, 0.0, 0.0, 1.0, 1)]
    d = summarize(only_one_token).to_dict()
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text)["tpot_s"] == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
    }
    assert d["ttft_breakdown_s"] == pytest.approx(
        {"queue": 0.0, "alloc": 0.1, "read": 1.0, "prefill": 0.2}
    )


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="no turn records"):
        summarize([])
    with pytest.raises(ValueError, match="request_id 0 recorded twice"):
        summarize([rec(0, 0, 0.0, 0.0, 1.0, 5), rec(0, 1, 0.0, 0.0, 1.0, 5)])
    with pytest.raises(ValueError, match="mode"):
        summarize(timeline(), mode="batch")


def test_nearest_rank_percentile() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 5.0
    assert percentile(values, 90) == 9.0
    assert percentile(values, 91) == 10.0
    assert percentile(values, 100) == 10.0
    assert math.isnan(percentile([], 50))
    assert Percentiles.from_values([3.0]).p99 == 3.0
    with pytest.raises(ValueError, match="q"):
        percentile(values, 101)


def test_format_summary_lists_each_system() -> None:
    one_token = [rec(0, 0, 0.0, 0.0, 1.0, 1)]
    text = format_summary({"basic": summarize(timeline()), "dualpath": summarize(one_token)})
    lines = text.splitlines()
    assert lines[0].split()[0] == "system"
    assert [line.split()[0] for line in lines[2:]] == ["basic", "dualpath"]
    assert f" {summarize(timeline()).jct_s:.1f} " in lines[2]  # JCT column
    assert lines[3].split().count("-") == 2  # no TTST, no TPOT samples
    assert len({len(line) for line in lines}) == 1  # aligned
