"""Where the time goes: TTFT breakdown per turn and per load, SNIC and attention load balance.

Pure functions over turn records, storage-transfer intervals and per-GPU forward times
(design §9). The components and their definitions are ``TurnRecord``'s; this module
aggregates them and never re-defines them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dualpath.config.checks import non_negative, positive, require
from dualpath.metrics.balance import max_over_avg, windowed_max_over_avg
from dualpath.metrics.record import TurnRecord
from dualpath.metrics.summary import TtftBreakdown

BREAKDOWN_COMPONENTS = ("queue_s", "alloc_s", "read_s", "prefill_s")


def turn_breakdown(record: TurnRecord) -> TtftBreakdown:
    """One turn's TTFT split: queue (arrival → scheduled), alloc (→ read start), read
    (→ read done), prefill (→ first token, incl. waiting for a forward pass). Sums to TTFT."""
    return TtftBreakdown(record.queue_s, record.alloc_s, record.read_s, record.prefill_s)


def mean_breakdown(records: Iterable[TurnRecord]) -> TtftBreakdown:
    """Component-wise mean over ``records`` (at least one); sums to the mean TTFT."""
    parts = [turn_breakdown(r) for r in records]
    if not parts:
        raise ValueError("mean_breakdown: no turn records")
    n = len(parts)
    return TtftBreakdown(
        *(math.fsum(getattr(p, name) for p in parts) / n for name in BREAKDOWN_COMPONENTS)
    )


def breakdown_by_aps(
    runs: Mapping[float, Iterable[TurnRecord]],
) -> tuple[tuple[float, TtftBreakdown], ...]:
    """Mean breakdown of each run keyed by its load (APS), in ascending APS."""
    return tuple((aps, mean_breakdown(runs[aps])) for aps in sorted(runs))


def breakdown_rows(
    system: str, by_aps: Sequence[tuple[float, TtftBreakdown]]
) -> list[dict[str, object]]:
    """Plain rows for plots and reports: {"system", "aps", "queue_s", ..., "ttft_s"}."""
    return [
        {
            "system": system,
            "aps": aps,
            **{name: getattr(b, name) for name in BREAKDOWN_COMPONENTS},
            "ttft_s": b.total_s,
        }
        for aps, b in by_aps
    ]


@dataclass(frozen=True, slots=True)
class TransferInterval:
    """``size_bytes`` moved through node ``node``'s SNIC between start_s and end_s,
    assumed at a constant rate (end_s == start_s: an instantaneous transfer)."""

    node: int
    start_s: float
    end_s: float
    size_bytes: float

    def __post_init__(self) -> None:
        non_negative("TransferInterval.start_s", self.start_s)
        require(
            self.end_s >= self.start_s,
            "TransferInterval.end_s",
            self.end_s,
            f">= start_s={self.start_s}",
        )
        non_negative("TransferInterval.size_bytes", self.size_bytes)


def snic_throughput(
    transfers: Iterable[TransferInterval], nodes: Sequence[int], bin_s: float, end_s: float
) -> list[tuple[float, list[float]]]:
    """Per-node SNIC throughput (bytes/s) in consecutive bins [k·bin_s, (k+1)·bin_s) up to
    ``end_s``, as ``(bin end time, [rate per node in ``nodes`` order])``. Each transfer's
    bytes are spread evenly over its interval; bytes past ``end_s`` are dropped. Nodes that
    moved nothing (e.g. idle decode SNICs in Basic) count, as zeros."""
    positive("bin_s", bin_s)
    positive("end_s", end_s)
    index = {node: i for i, node in enumerate(nodes)}
    require(len(index) == len(nodes), "nodes", list(nodes), "distinct node ids")
    num_bins = math.ceil(end_s / bin_s - 1e-9)
    bins = [[0.0] * len(nodes) for _ in range(num_bins)]
    for t in transfers:
        require(t.node in index, "TransferInterval.node", t.node, f"one of nodes {list(nodes)}")
        column = index[t.node]
        if t.end_s == t.start_s:
            k = int(t.start_s // bin_s)
            if k < num_bins:
                bins[k][column] += t.size_bytes
            continue
        rate = t.size_bytes / (t.end_s - t.start_s)
        first = int(t.start_s // bin_s)
        last = min(num_bins - 1, int(t.end_s // bin_s))
        for k in range(first, last + 1):
            overlap = min(t.end_s, (k + 1) * bin_s) - max(t.start_s, k * bin_s)
            if overlap > 0:
                bins[k][column] += rate * overlap
    return [((k + 1) * bin_s, [b / bin_s for b in row]) for k, row in enumerate(bins)]


def rates_from_counters(
    samples: Sequence[tuple[float, Sequence[float]]],
) -> list[tuple[float, list[float]]]:
    """Per-node rates from cumulative byte counters sampled over time: for consecutive
    samples (t0, c0), (t1, c1) → (t1, (c1 - c0) / (t1 - t0)). Times strictly increase and
    counters never decrease."""
    out: list[tuple[float, list[float]]] = []
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        require(t1 > t0, "counter sample time", t1, f"> previous {t0}")
        require(len(c1) == len(c0), "counter sample width", len(c1), f"== {len(c0)}")
        deltas = [b - a for a, b in zip(c0, c1, strict=True)]
        require(min(deltas, default=0.0) >= 0, "counter delta", min(deltas, default=0.0), ">= 0")
        out.append((t1, [d / (t1 - t0) for d in deltas]))
    return out


def snic_balance(
    transfers: Iterable[TransferInterval],
    nodes: Sequence[int],
    bin_s: float,
    window_s: float,
    end_s: float,
) -> list[tuple[float, float]]:
    """SNIC max/avg across ``nodes`` over time: ``snic_throughput`` in bins of ``bin_s``,
    then ``windowed_max_over_avg`` over sliding windows of ``window_s``."""
    return windowed_max_over_avg(snic_throughput(transfers, nodes, bin_s, end_s), window_s)


def attention_balance(
    forwards: Iterable[tuple[float, Sequence[float]]], skip_idle: bool = False
) -> list[tuple[float, float]]:
    """Per-forward attention max/avg across the GPUs of one EP group: ``forwards`` are
    (time_s, [attention seconds per GPU]); returns (time_s, max/avg) in the given order.
    1.0 = no bubble; a forward where no GPU attended anything counts as balanced, or with
    ``skip_idle`` is left out (no data is not balance)."""
    return [
        (time_s, max_over_avg(per_gpu_s))
        for time_s, per_gpu_s in forwards
        if not skip_idle or any(per_gpu_s)
    ]


def series_stats(series: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Mean and max of a (time, value) series plus its sample count (NaN if empty)."""
    values = [v for _, v in series]
    if not values:
        return {"mean": math.nan, "max": math.nan, "count": 0}
    return {"mean": math.fsum(values) / len(values), "max": max(values), "count": len(values)}
