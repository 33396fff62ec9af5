"""Chrome / Perfetto trace export: valid Trace Event JSON, right fields and durations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.metrics.chrome_trace import (
    CounterSample,
    Span,
    natural_key,
    trace_events,
    write_chrome_trace,
)

SPANS = [
    Span("pe10", "prefill fwd 1", 1.0, 1.25, {"tokens": 4096}, process="node 0"),
    Span("pe2", "read", 0.5, 0.75, process="node 0", category="storage"),
    Span("pe2", "prefill fwd 0", 0.75, 1.0, process="node 0"),
    Span("de0", "decode step", 1.5, 1.52, process="node 1"),
]


def test_trace_loads_with_fields_and_durations(tmp_path: Path) -> None:
    path = write_chrome_trace(SPANS, tmp_path / "sub" / "trace.json")
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(SPANS)
    for e in complete:
        assert set(e) == {"name", "cat", "ph", "pid", "tid", "ts", "dur", "args"}
    by_name = {e["name"]: e for e in complete}
    assert by_name["read"]["ts"] == pytest.approx(500_000.0)
    assert by_name["read"]["dur"] == pytest.approx(250_000.0)
    assert by_name["read"]["cat"] == "storage"
    assert by_name["decode step"]["dur"] == pytest.approx(20_000.0)
    assert by_name["prefill fwd 1"]["args"] == {"tokens": 4096}


def test_pid_per_process_tid_per_track_with_names() -> None:
    events = trace_events(SPANS)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]  # type: ignore[index]
        for e in events
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
    }
    assert names[(1, 0)] == "node 0" and names[(2, 0)] == "node 1"
    # natural order: pe2 before pe10
    assert names[(1, 1)] == "pe2" and names[(1, 2)] == "pe10" and names[(2, 1)] == "de0"
    complete = [e for e in events if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"]) for e in complete] == [
        (1, 1, "read"),
        (1, 1, "prefill fwd 0"),
        (1, 2, "prefill fwd 1"),
        (2, 1, "decode step"),
    ]
    # metadata precedes every complete event
    assert max(i for i, e in enumerate(events) if e["ph"] == "M") < min(
        i for i, e in enumerate(events) if e["ph"] == "X"
    )


def test_deterministic_bytes_regardless_of_input_order(tmp_path: Path) -> None:
    a = write_chrome_trace(SPANS, tmp_path / "a.json").read_bytes()
    b = write_chrome_trace(list(reversed(SPANS)), tmp_path / "b.json").read_bytes()
    assert a == b


def test_counters() -> None:
    counters = [
        CounterSample("node 0", "snic GB/s", 2.0, {"read": 40.0}),
        CounterSample("node 0", "snic GB/s", 1.0, {"read": 10.0, "write": 1.0}),
    ]
    events = [e for e in trace_events(SPANS, counters) if e["ph"] == "C"]
    assert [e["ts"] for e in events] == [1_000_000.0, 2_000_000.0]
    assert events[0]["args"] == {"read": 10.0, "write": 1.0}
    assert events[0]["pid"] == 1


def test_span_validation_and_natural_key() -> None:
    with pytest.raises(ValueError, match=r"Span\.end_s=0\.5"):
        Span("pe0", "x", 1.0, 0.5)
    with pytest.raises(ValueError, match=r"Span\.track"):
        Span("", "x", 0.0, 1.0)
    assert sorted(["pe10", "pe2", "de1"], key=natural_key) == ["de1", "pe2", "pe10"]
