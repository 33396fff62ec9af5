"""Latency SLO (design §9): the check of a finished run and the online stop rule.

Pure: fed turn records, never reads a clock. The statistic is configurable (``quantile``):
``None`` = the mean (default; the paper's stop rule and figures read as averages), a number
q in [0, 100] = the nearest-rank q-th percentile (100 = every turn must meet the SLO).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from dualpath.config.checks import positive, require
from dualpath.metrics.percentiles import percentile
from dualpath.metrics.record import TurnRecord


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-turn latency targets: TTFT ≤ ttft_s and TPOT ≤ tpot_s (paper: 4 s, 50 ms)."""

    ttft_s: float = 4.0
    tpot_s: float = 0.050

    def __post_init__(self) -> None:
        require(math.isfinite(self.ttft_s) and self.ttft_s > 0, "SLO.ttft_s", self.ttft_s, "> 0")
        require(math.isfinite(self.tpot_s) and self.tpot_s > 0, "SLO.tpot_s", self.tpot_s, "> 0")


def _check_quantile(quantile: float | None) -> None:
    if quantile is not None:
        require(0 <= quantile <= 100, "quantile", quantile, "None (mean) or in [0, 100]")


def statistic(values: Sequence[float], quantile: float | None) -> float:
    """Mean of ``values`` (quantile None) or their nearest-rank percentile; NaN if empty."""
    _check_quantile(quantile)
    if not values:
        return math.nan
    if quantile is None:
        return math.fsum(values) / len(values)
    return percentile(sorted(values), quantile)


@dataclass(frozen=True, slots=True)
class SloCheck:
    """Outcome of ``check_slo``. ``tpot_s`` is NaN when no turn had more than two tokens
    (TPOT undefined): the TPOT target then counts as met."""

    passed: bool
    ttft_s: float
    tpot_s: float
    ttft_ok: bool
    tpot_ok: bool
    num_turns: int
    quantile: float | None


def check_slo(
    records: Iterable[TurnRecord], slo: SLO | None = None, quantile: float | None = None
) -> SloCheck:
    """Does a run meet ``slo``? TTFT and TPOT statistics over all ``records`` (mean by default,
    see module doc) must each be ≤ their target. ValueError if there are no records."""
    slo = SLO() if slo is None else slo
    _check_quantile(quantile)
    recs = list(records)
    if not recs:
        raise ValueError("check_slo: no turn records (a run must finish at least one turn)")
    ttft = statistic([r.ttft_s for r in recs], quantile)
    tpot = statistic([r.tpot_s for r in recs if r.tpot_s is not None], quantile)
    ttft_ok = ttft <= slo.ttft_s
    tpot_ok = math.isnan(tpot) or tpot <= slo.tpot_s
    return SloCheck(ttft_ok and tpot_ok, ttft, tpot, ttft_ok, tpot_ok, len(recs), quantile)


class StopReason(StrEnum):
    """Why an online run stopped (design §9)."""

    TTFT_OVER_SLO = "ttft_over_slo"
    TPOT_OVER_SLO = "tpot_over_slo"
    STEADY_STATE = "steady_state"

    @property
    def is_slo_break(self) -> bool:
        return self is not StopReason.STEADY_STATE


class _Series:
    """Samples in non-decreasing time with prefix sums: window means in O(log n)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.values: list[float] = []
        self.prefix: list[float] = [0.0]

    def add(self, time_s: float, value: float) -> None:
        self.times.append(time_s)
        self.values.append(value)
        self.prefix.append(self.prefix[-1] + value)

    def bounds(self, lo_s: float, hi_s: float) -> tuple[int, int]:
        """Index range of samples with time in (lo_s, hi_s]."""
        return bisect.bisect_right(self.times, lo_s), bisect.bisect_right(self.times, hi_s)

    def mean(self, lo_s: float, hi_s: float) -> tuple[float, int]:
        i, j = self.bounds(lo_s, hi_s)
        return ((self.prefix[j] - self.prefix[i]) / (j - i) if j > i else math.nan), j - i

    def stat(self, lo_s: float, hi_s: float, quantile: float | None) -> tuple[float, int]:
        if quantile is None:
            return self.mean(lo_s, hi_s)
        i, j = self.bounds(lo_s, hi_s)
        return statistic(self.values[i:j], quantile), j - i


class StopRule:
    """Online stop rule (design §9), fed completed turns in time order via ``observe``.

    A record is observed at ``now_s`` (default: its ``finish_s``); times must not go back.
    After each observation, over the turns observed in (now - window_s, now]:
    - TTFT_OVER_SLO / TPOT_OVER_SLO: the statistic (``quantile``, mean by default) of TTFT
      (resp. TPOT) exceeds the SLO, once the window holds ≥ ``min_samples`` turns;
    - STEADY_STATE: once now ≥ max(first arrival, ``warmup_s``) + lookback_s + window_s, the
      window's mean TTFT is within ``rel_tol`` (relative) of the mean over the same-length
      window ending ``lookback_s`` earlier (paper: 150 s window, 30 min lookback, 5 %).
    An SLO break wins over steady state. The first reason latches: later calls return it.
    """

    def __init__(
        self,
        slo: SLO | None = None,
        window_s: float = 150.0,
        lookback_s: float = 1800.0,
        rel_tol: float = 0.05,
        quantile: float | None = None,
        min_samples: int = 1,
        warmup_s: float = 0.0,
    ) -> None:
        positive("StopRule.window_s", window_s)
        require(warmup_s >= 0, "StopRule.warmup_s", warmup_s, ">= 0")
        positive("StopRule.lookback_s", lookback_s)
        require(rel_tol >= 0, "StopRule.rel_tol", rel_tol, ">= 0")
        require(min_samples >= 1, "StopRule.min_samples", min_samples, ">= 1")
        _check_quantile(quantile)
        self.slo = SLO() if slo is None else slo
        self.window_s = window_s
        self.lookback_s = lookback_s
        self.rel_tol = rel_tol
        self.quantile = quantile
        self.min_samples = min_samples
        self.warmup_s = warmup_s
        self._ttft = _Series()
        self._tpot = _Series()
        self._first_arrival_s = math.inf
        self._now_s = -math.inf
        self.reason: StopReason | None = None
        self.stopped_at_s: float | None = None

    def observe(self, record: TurnRecord, now_s: float | None = None) -> StopReason | None:
        """Add one finished turn; return the stop reason, or None to keep running."""
        now = record.finish_s if now_s is None else now_s
        require(now >= self._now_s, "StopRule.observe now_s", now, f">= {self._now_s} (time order)")
        self._now_s = now
        self._first_arrival_s = min(self._first_arrival_s, record.arrival_s)
        self._ttft.add(now, record.ttft_s)
        if record.tpot_s is not None:
            self._tpot.add(now, record.tpot_s)
        if self.reason is None:
            self.reason = self._evaluate(now)
            if self.reason is not None:
                self.stopped_at_s = now
        return self.reason

    def _evaluate(self, now: float) -> StopReason | None:
        lo = now - self.window_s
        ttft, num = self._ttft.stat(lo, now, self.quantile)
        if num >= self.min_samples and ttft > self.slo.ttft_s:
            return StopReason.TTFT_OVER_SLO
        tpot, num_tpot = self._tpot.stat(lo, now, self.quantile)
        if num_tpot >= self.min_samples and tpot > self.slo.tpot_s:
            return StopReason.TPOT_OVER_SLO
        if now < max(self._first_arrival_s, self.warmup_s) + self.lookback_s + self.window_s:
            return None
        current, _ = self._ttft.mean(lo, now)
        past, num_past = self._ttft.mean(lo - self.lookback_s, now - self.lookback_s)
        if num_past and abs(current - past) <= self.rel_tol * past:
            return StopReason.STEADY_STATE
        return None


def first_stop(records: Iterable[TurnRecord], rule: StopRule) -> StopReason | None:
    """Feed ``records`` to ``rule`` in finish order (ties by request id); the first reason."""
    for record in sorted(records, key=lambda r: (r.finish_s, r.request_id)):
        if rule.observe(record) is not None:
            break
    return rule.reason
