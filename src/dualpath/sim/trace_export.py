"""Chrome / Perfetto trace of one simulated run (debugging aid).

Spans come from an ``Observer`` attached with ``spans=True``: storage reads, layer loads,
PE→DE sends, H2D, persistence and collectives (one track per kind and first resource),
each prefill forward per PE, each decode macro-step per DE. Overlapping spans of one track
(e.g. several sends from one CNIC) are spread over lanes ``track #k`` so that every track
is a proper stack. SNIC read throughput per node is added as counter tracks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from dualpath.metrics.breakdown import rates_from_counters
from dualpath.metrics.chrome_trace import CounterSample, Span, write_chrome_trace
from dualpath.sim.online import OnlineResult


def assign_lanes(spans: Sequence[Span]) -> list[Span]:
    """Spans with overlapping siblings on one (process, track) moved to extra lanes: the
    first lane keeps the track name, lane k > 0 becomes ``track #k``. Deterministic."""
    ordered = sorted(spans, key=lambda s: (s.process, s.track, s.start_s, s.end_s, s.name))
    lanes: dict[tuple[str, str], list[float]] = {}
    out: list[Span] = []
    for span in ordered:
        ends = lanes.setdefault((span.process, span.track), [])
        for k, end in enumerate(ends):
            if end <= span.start_s:
                ends[k] = span.end_s
                break
        else:
            k = len(ends)
            ends.append(span.end_s)
        out.append(span if k == 0 else dataclasses.replace(span, track=f"{span.track} #{k}"))
    return out


def snic_counters(result: OnlineResult) -> list[CounterSample]:
    """SNIC read GB/s per node as counter samples (from the run's cumulative counters)."""
    out: list[CounterSample] = []
    for t, rates in rates_from_counters(list(result.snic_samples)):
        for node, rate in enumerate(rates):
            out.append(CounterSample(f"node{node}", "snic_read_GBps", t, {"read": rate / 1e9}))
    return out


def export_trace(result: OnlineResult, path: str | Path, max_spans: int = 200_000) -> Path:
    """Write the run's spans (the first ``max_spans`` by start time) and SNIC counters."""
    if result.observer is None or not result.observer.record_spans:
        raise ValueError("trace export needs a run with spans=True")
    spans = sorted(result.observer.spans, key=lambda s: (s.start_s, s.process, s.track))
    return write_chrome_trace(assign_lanes(spans[:max_spans]), path, snic_counters(result))
