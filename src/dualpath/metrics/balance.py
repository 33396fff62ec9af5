"""Load-balance metrics: max/avg of per-node (or per-GPU) loads, overall and in sliding windows.

Pure functions (e.g. SNIC throughput per node over time, attention time per GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dualpath.config.checks import positive


def max_over_avg(values: Sequence[float]) -> float:
    """max(values) / mean(values): 1.0 is perfect balance. All-zero loads count as balanced
    (1.0). Raises ValueError for an empty sequence or a negative value."""
    if len(values) == 0:
        raise ValueError("max_over_avg: values is empty: need at least one load")
    if min(values) < 0:
        raise ValueError(f"max_over_avg: loads must be >= 0, got {min(values)!r}")
    total = math.fsum(values)
    if total == 0:
        return 1.0
    return max(values) * len(values) / total


def windowed_max_over_avg(
    samples: Sequence[tuple[float, Sequence[float]]], window_s: float, skip_idle: bool = False
) -> list[tuple[float, float]]:
    """Sliding-window load balance of a per-node time series.

    ``samples`` are ``(time_s, loads)`` in non-decreasing time, every ``loads`` the same length
    (one value per node, e.g. SNIC bytes/s over the last sampling interval). For each sample
    at time t the window holds the samples with time in (t - window_s, t]; each node's load is
    averaged over the window and ``max_over_avg`` of those averages is reported as
    ``(t, ratio)``. Cost is O(samples × nodes). ``skip_idle``: a window in which no node
    carried anything is left out (no data is not balance) instead of reported as 1.0.
    """
    positive("window_s", window_s)
    if not samples:
        return []
    width = len(samples[0][1])
    for index, (time_s, loads) in enumerate(samples):
        if len(loads) != width:
            raise ValueError(
                f"windowed_max_over_avg: sample {index} has {len(loads)} loads, expected {width}"
            )
        if any(load < 0 for load in loads):
            raise ValueError(f"windowed_max_over_avg: sample {index} has a negative load")
        if index and time_s < samples[index - 1][0]:
            raise ValueError(f"windowed_max_over_avg: sample {index} time {time_s} goes backwards")
    sums = [0.0] * width
    nonzero = [0] * width  # exact count per node: a node with none in the window sums to 0
    out: list[tuple[float, float]] = []
    head = 0  # first sample inside the window
    for time_s, loads in samples:
        for node, load in enumerate(loads):
            sums[node] += load
            nonzero[node] += load != 0
        while samples[head][0] <= time_s - window_s:
            for node, load in enumerate(samples[head][1]):
                sums[node] -= load
                nonzero[node] -= load != 0
            head += 1
        # running sums drift by rounding: snap empty nodes to 0 and tiny negatives to 0
        window = [max(0.0, s) if n else 0.0 for s, n in zip(sums, nonzero, strict=True)]
        if skip_idle and not any(nonzero):
            continue
        # every node's mean shares one divisor, so max/avg of sums equals max/avg of means
        out.append((time_s, max_over_avg(window)))
    return out
