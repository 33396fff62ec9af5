"""Chrome / Perfetto trace export (Trace Event JSON) of a run's spans, for debugging.

Owns the format only: shells hand it spans (reads, prefill forwards, transfers, decode
steps). Output order is deterministic: processes and tracks by natural name order.
Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.config.checks import require

_US_PER_S = 1e6


@dataclass(frozen=True, slots=True)
class Span:
    """A named interval on one track (an engine, a NIC, a link) of one process (a node).

    ``args`` are shown in the trace viewer's detail pane; values must be JSON-serialisable.
    """

    track: str
    name: str
    start_s: float
    end_s: float
    args: Mapping[str, object] = field(default_factory=dict)
    process: str = "cluster"
    category: str = ""

    def __post_init__(self) -> None:
        require(bool(self.track), "Span.track", self.track, "a non-empty name")
        require(bool(self.name), "Span.name", self.name, "a non-empty name")
        require(math.isfinite(self.start_s), "Span.start_s", self.start_s, "finite")
        require(
            math.isfinite(self.end_s) and self.end_s >= self.start_s,
            "Span.end_s",
            self.end_s,
            f">= start_s={self.start_s} and finite",
        )


@dataclass(frozen=True, slots=True)
class CounterSample:
    """Values of one counter track (e.g. SNIC bytes/s by direction) from ``time_s`` on."""

    process: str
    name: str
    time_s: float
    values: Mapping[str, float]


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders 'pe2' before 'pe10'."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    )


def _metadata(kind: str, pid: int, tid: int, name: str, order: int) -> list[dict[str, object]]:
    base: dict[str, object] = {"ph": "M", "pid": pid, "tid": tid}
    return [
        {**base, "name": f"{kind}_name", "args": {"name": name}},
        {**base, "name": f"{kind}_sort_index", "args": {"sort_index": order}},
    ]


def trace_events(
    spans: Iterable[Span], counters: Iterable[CounterSample] = ()
) -> list[dict[str, object]]:
    """The Trace Event list: metadata first, then complete events ("ph": "X", ts and dur in
    µs) per (pid, tid) in start order, then counter events ("ph": "C")."""
    span_list = list(spans)
    counter_list = list(counters)
    processes = sorted(
        {s.process for s in span_list} | {c.process for c in counter_list}, key=natural_key
    )
    pids = {name: i + 1 for i, name in enumerate(processes)}
    tids: dict[tuple[str, str], int] = {}
    for process in processes:
        tracks = sorted({s.track for s in span_list if s.process == process}, key=natural_key)
        for i, track in enumerate(tracks):
            tids[(process, track)] = i + 1
    events: list[dict[str, object]] = []
    for process in processes:
        events += _metadata("process", pids[process], 0, process, pids[process])
    for (process, track), tid in tids.items():
        events += _metadata("thread", pids[process], tid, track, tid)
    span_list.sort(
        key=lambda s: (
            pids[s.process],
            tids[(s.process, s.track)],
            s.start_s,
            s.start_s - s.end_s,  # longest first: parents before children
            s.name,
            json.dumps(dict(s.args), sort_keys=True, default=str),
        )
    )
    events += [
        {
            "name": s.name,
            "cat": s.category or s.track,
            "ph": "X",
            "pid": pids[s.process],
            "tid": tids[(s.process, s.track)],
            "ts": s.start_s * _US_PER_S,
            "dur": (s.end_s - s.start_s) * _US_PER_S,
            "args": dict(s.args),
        }
        for s in span_list
    ]
    counter_list.sort(key=lambda c: (pids[c.process], c.name, c.time_s))
    events += [
        {
            "name": c.name,
            "ph": "C",
            "pid": pids[c.process],
            "tid": 0,
            "ts": c.time_s * _US_PER_S,
            "args": dict(sorted(c.values.items())),
        }
        for c in counter_list
    ]
    return events


def write_chrome_trace(
    spans: Iterable[Span], path: str | Path, counters: Iterable[CounterSample] = ()
) -> Path:
    """Write ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` to ``path`` (parents
    created); returns the path. Same spans ⇒ byte-identical file."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"traceEvents": trace_events(spans, counters), "displayTimeUnit": "ms"}
    with out.open("w", encoding="utf-8") as f:
        json.dump(document, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    return out
