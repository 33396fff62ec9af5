"""`dualpath loadgen` against a real `dualpath serve`: agents and a Mooncake trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tests.serve.conftest import ServerProc

from dualpath.cli.main import main
from dualpath.workload.scripts import chat_scripts, trace_scripts

TRACE = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)


def test_chat_scripts_are_seeded_and_scaled() -> None:
    a = chat_scripts(4, 3, token_scale=0.05, max_gen_tokens=8, seed=1)
    assert a == chat_scripts(4, 3, token_scale=0.05, max_gen_tokens=8, seed=1)
    assert a != chat_scripts(4, 3, token_scale=0.05, max_gen_tokens=8, seed=2)
    assert len(a) == 4 and all(len(s.turns) == 3 for s in a)
    assert all(t.max_tokens <= 8 and t.append_words >= 1 for s in a for t in s.turns)
    assert len({s.session_id for s in a}) == 4


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_loadgen_agents_against_serve(hf_server: ServerProc, tmp_path: Path) -> None:
    out = tmp_path / "lg.json"
    rc = main(
        [
            "loadgen",
            "--url",
            hf_server.url,
            "--api-key",
            "sk-test",
            "--agents",
            "4",
            "--turns",
            "3",
            "--concurrency",
            "4",
            "--max-gen",
            "6",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["requests"] == 12 and s["errors"] == 0
    assert 0 < s["hit_ratio"] < 1  # turns 2 and 3 resend the conversation
    assert s["cached_tokens"] > 0
    for key in ("ttft_s", "ttst_s", "tpot_s", "itl_s", "chunk_gap_s", "agent_jct_s"):
        assert s[key]["count"] > 0 and math.isfinite(s[key]["p99"]), key
    assert s["ttft_s"]["p50"] <= s["agent_jct_s"]["p50"]
    # tokens arrive as the DE makes them, one SSE event each: not in bursts (a burst's gaps
    # are ~0.05 ms against a TPOT of milliseconds)
    assert s["chunk_gap_s"]["p50"] >= 0.2 * s["tpot_s"]["p50"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_loadgen_replays_a_mooncake_trace(hf_server: ServerProc, tmp_path: Path) -> None:
    if not TRACE.is_file():
        pytest.skip(f"{TRACE} is absent (shared traces folder)")
    scripts = trace_scripts(str(TRACE), 0.01, 4, speedup=0.0, limit=30)
    assert sum(len(s.turns) for s in scripts) == 30
    out = tmp_path / "trace.json"
    rc = main(
        [
            "loadgen",
            "--url",
            hf_server.url,
            "--api-key",
            "sk-test",
            "--trace",
            str(TRACE),
            "--limit",
            "30",
            "--token-scale",
            "0.01",
            "--max-gen",
            "4",
            "--api",
            "completions",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["requests"] == 30 and s["errors"] == 0


def test_loadgen_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadgen", "--url", "ftp://x", "--agents", "1"]) == 2
    assert "--url 'ftp://x' is invalid" in capsys.readouterr().err
    assert main(["loadgen", "--url", "http://127.0.0.1:1", "--agents", "1", "--no-progress"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
