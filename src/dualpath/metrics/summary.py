"""Summary of a run's turn records: JCT, TTFT/TTST/TPOT percentiles, TTFT breakdown, throughput.

Used by the simulator and the runtime alike; pure function of the records.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from dualpath.config.checks import one_of
from dualpath.metrics.percentiles import Percentiles
from dualpath.metrics.record import TurnRecord

SUMMARY_MODES = ("offline", "online")


@dataclass(frozen=True, slots=True)
class TtftBreakdown:
    """Mean TTFT components over all turns; they sum to the mean TTFT (up to rounding)."""

    queue_s: float
    alloc_s: float
    read_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.alloc_s + self.read_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Metrics of one run. ``jct_s`` = last finish - first arrival (the offline JCT; the
    makespan online). Throughputs are tokens over ``jct_s``. Percentiles are nearest-rank."""

    mode: str
    num_turns: int
    num_agents: int
    start_s: float
    end_s: float
    jct_s: float
    agent_jct: Percentiles  # per agent: its last finish - its first arrival
    ttft: Percentiles
    ttst: Percentiles  # turns with output_tokens >= 2
    tpot: Percentiles  # turns with output_tokens > 2
    breakdown: TtftBreakdown
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    hit_ratio: float  # hit tokens / prompt tokens
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    read_side_shares: tuple[tuple[str, float], ...]  # (side, share of turns), by side name

    def to_dict(self) -> dict[str, object]:
        """JSON-safe dict (NaN → None, tuples → lists/dicts)."""
        return {
            "mode": self.mode,
            "num_turns": self.num_turns,
            "num_agents": self.num_agents,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "jct_s": self.jct_s,
            "agent_jct_s": self.agent_jct.to_dict(),
            "ttft_s": self.ttft.to_dict(),
            "ttst_s": self.ttst.to_dict(),
            "tpot_s": self.tpot.to_dict(),
            "ttft_breakdown_s": {
                "queue": self.breakdown.queue_s,
                "alloc": self.breakdown.alloc_s,
                "read": self.breakdown.read_s,
                "prefill": self.breakdown.prefill_s,
            },
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "output_tokens": self.output_tokens,
            "hit_ratio": self.hit_ratio,
            "prompt_tokens_per_s": _finite_or_none(self.prompt_tokens_per_s),
            "output_tokens_per_s": _finite_or_none(self.output_tokens_per_s),
            "read_side_shares": dict(self.read_side_shares),
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def summarize(records: Iterable[TurnRecord], mode: str = "offline") -> RunSummary:
    """Summarise ``records`` (at least one; request ids unique). ``mode`` is recorded only:
    every metric is computed in both modes."""
    one_of("mode", mode, SUMMARY_MODES)
    recs = sorted(records, key=lambda r: r.request_id)
    if not recs:
        raise ValueError("summarize: no turn records (a run must finish at least one turn)")
    for before, after in itertools.pairwise(recs):
        if before.request_id == after.request_id:
            raise ValueError(f"summarize: request_id {after.request_id} recorded twice")
    start_s = min(r.arrival_s for r in recs)
    end_s = max(r.finish_s for r in recs)
    jct_s = end_s - start_s
    spans: dict[int, tuple[float, float]] = {}
    for r in recs:
        first, last = spans.get(r.agent_id, (r.arrival_s, r.finish_s))
        spans[r.agent_id] = (min(first, r.arrival_s), max(last, r.finish_s))
    sides: dict[str, int] = {}
    for r in recs:
        sides[r.read_side] = sides.get(r.read_side, 0) + 1
    prompt = sum(r.prompt_tokens for r in recs)
    hit = sum(r.hit_tokens for r in recs)
    output = sum(r.output_tokens for r in recs)
    per_s = (lambda tokens: tokens / jct_s) if jct_s > 0 else (lambda tokens: math.inf)
    return RunSummary(
        mode=mode,
        num_turns=len(recs),
        num_agents=len(spans),
        start_s=start_s,
        end_s=end_s,
        jct_s=jct_s,
        agent_jct=Percentiles.from_values([last - first for first, last in spans.values()]),
        ttft=Percentiles.from_values([r.ttft_s for r in recs]),
        ttst=Percentiles.from_values([r.ttst_s for r in recs if r.ttst_s is not None]),
        tpot=Percentiles.from_values([r.tpot_s for r in recs if r.tpot_s is not None]),
        breakdown=TtftBreakdown(
            queue_s=_mean([r.queue_s for r in recs]),
            alloc_s=_mean([r.alloc_s for r in recs]),
            read_s=_mean([r.read_s for r in recs]),
            prefill_s=_mean([r.prefill_s for r in recs]),
        ),
        prompt_tokens=prompt,
        hit_tokens=hit,
        output_tokens=output,
        hit_ratio=hit / prompt,
        prompt_tokens_per_s=per_s(prompt),
        output_tokens_per_s=per_s(output),
        read_side_shares=tuple((side, sides[side] / len(recs)) for side in sorted(sides)),
    )
