"""Metrics shared by the simulator and the runtime: turn records, summaries, load balance."""

from dualpath.metrics.balance import max_over_avg, windowed_max_over_avg
from dualpath.metrics.percentiles import Percentiles, percentile
from dualpath.metrics.record import TurnRecord
from dualpath.metrics.summary import RunSummary, TtftBreakdown, summarize
from dualpath.metrics.table import format_summary

__all__ = [
    "Percentiles",
    "RunSummary",
    "TtftBreakdown",
    "TurnRecord",
    "format_summary",
    "max_over_avg",
    "percentile",
    "summarize",
    "windowed_max_over_avg",
]
