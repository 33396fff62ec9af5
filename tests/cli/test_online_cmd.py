"""`dualpath online | capacity | ablation | replay | trace`: wiring, output, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.cli.online_cmd import DEFAULT_TRACE

FAST = ["--preset", "ds27b-1p1d", "--mal", "32k", "--set", "workload.num_base_trajectories=8"]


def test_online_prints_a_row_per_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["online", *FAST, "--aps", "1", "--horizon-s", "15", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "basic" in out and "dualpath" in out and "ttft_s" in out
    payload = json.loads((tmp_path / "online.json").read_text())
    rows = payload["rows"]
    assert [r["system"] for r in rows] == ["basic", "dualpath"]
    assert payload["run"]["config"]["name"] == "ds27b-1p1d" and payload["run"]["seed"] == 0
    assert payload["run"]["settings"]["horizon_s"] == 15.0
    assert payload["run"]["code_version"]["source_sha256"]
    assert all(r["ttft_s"] > 0 for r in rows)


def test_capacity_prints_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "capacity",
        *FAST,
        "--horizon-s",
        "20",
        "--window-s",
        "5",
        "--lookback-s",
        "5",
        "--lo",
        "0.5",
        "--hi",
        "1",
        "--max-probes",
        "2",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DualPath/Basic capacity ratio" in out
    payload = json.loads((tmp_path / "capacity.json").read_text())
    rows = payload["rows"]
    assert payload["run"]["config"]["workload"]["mal"] == "32k"
    assert {r["system"] for r in rows} == {"basic", "dualpath"}
    for r in rows:  # the storage bound: a column and an output line per system
        assert 0 < r["capacity_aps"] <= r["storage_bound_aps"]
        assert f"storage bound {r['system']}: capacity" in out
    assert all(len(r["probes"]) == 2 for r in rows)


def test_trace_writes_a_chrome_trace(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["trace", *FAST, "--horizon-s", "5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert any(e["ph"] == "X" for e in doc["traceEvents"])


def test_replay_skips_clearly_or_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = DEFAULT_TRACE / "mooncake_synthetic_trace.jsonl"
    if not trace.is_file():
        pytest.skip(f"Mooncake trace not found at {trace}")
    argv = [
        "replay",
        *FAST,
        "--trace-name",
        "mooncake_synthetic_trace.jsonl",
        "--speedup",
        "1,4",
        "--horizon-s",
        "5",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "replay.json").read_text())
    rows = payload["rows"]
    assert payload["run"]["config"]["name"] == "ds27b-1p1d"
    assert [(r["system"], r["speedup"]) for r in rows] == [
        ("basic", 1.0),
        ("dualpath", 1.0),
        ("basic", 4.0),
        ("dualpath", 4.0),
    ]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["online", *FAST, "--aps", "-1"], "aps"),
        (["online", *FAST, "--aps", "1", "--systems", "nope"], "sim.systems"),
        (["replay", *FAST, "--trace-file", "/nonexistent.jsonl"], "trace"),
        (["capacity", *FAST, "--lo", "2", "--hi", "1"], "--hi"),
    ],
)
def test_user_mistakes_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dualpath: error:") and needle in err and "\n" not in err


def test_ablation_reads_the_shared_cache_and_records_its_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ablation", *FAST, "--agents", "4", "--no-progress", "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert "4 simulated" in capsys.readouterr().out
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "4 from cache, 0 simulated" in capsys.readouterr().out
    first, again = (json.loads((tmp_path / d / "ablation.json").read_text()) for d in "ab")
    assert first == again
    assert [r["system"] for r in first["rows"]] == ["Basic", "+Layer", "+DPL", "+Sched"]
    assert first["run"]["config"]["workload"]["num_agents"] == 4


def test_trace_spans_name_their_requests_and_decode_steps(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["trace", *FAST, "--horizon-s", "8", "--aps", "2", "--out", str(out)]
    assert main([*argv, "--decode-steps"]) == 0
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    turns = [e for e in events if e["cat"] == "turn"]
    assert turns and all("request_id" in e["args"] for e in turns)
    rid = turns[0]["args"]["request_id"]
    phases = {e["name"].split(" ", 2)[2] for e in turns if e["args"]["request_id"] == rid}
    assert any(p.startswith("prefill pe") for p in phases)
    forwards = [e for e in events if e["name"] == "prefill"]
    assert any(rid in e["args"]["request_ids"] for e in forwards)  # found on its PE
    decodes = [e for e in events if e["name"] == "decode"]
    assert decodes and all(e["args"]["steps"] == 1 for e in decodes)
    assert any(rid in e["args"]["request_ids"] for e in decodes)  # and on its DE
    assert main([*argv, "--out", str(tmp_path / "macro.json")]) == 0
    macro = json.loads((tmp_path / "macro.json").read_text())["traceEvents"]
    assert max(e["args"].get("steps", 0) for e in macro if e.get("name") == "decode") > 1
