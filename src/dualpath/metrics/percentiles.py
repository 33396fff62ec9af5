"""Percentile summaries by the nearest-rank method. Pure functions; NaN marks "no samples"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.config.checks import require


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ascending ``sorted_values``: the ceil(q/100 · n)-th smallest
    (the smallest value for q = 0). Always a sample, never interpolated. NaN if empty."""
    require(0 <= q <= 100, "q", q, "in [0, 100]")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    rank = max(1, math.ceil(q / 100 * n - 1e-9))  # tolerance: q/100·n that is an integer
    return float(sorted_values[min(rank, n) - 1])


@dataclass(frozen=True, slots=True)
class Percentiles:
    """count, mean, p50, p90, p99 and max of one metric (NaN everywhere when count == 0)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def from_values(cls, values: Sequence[float]) -> Percentiles:
        ordered = sorted(values)
        if not ordered:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            max=float(ordered[-1]),
        )

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-safe: NaN becomes None."""
        out: dict[str, float | int | None] = {"count": self.count}
        for name in ("mean", "p50", "p90", "p99", "max"):
            value = getattr(self, name)
            out[name] = None if math.isnan(value) else value
        return out
