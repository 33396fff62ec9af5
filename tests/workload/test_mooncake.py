"""Mooncake trace loader: prefix-trie hits, sessions, bad lines; the shared traces if present."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from dualpath.workload import TraceRequest, load_mooncake

TRACES = (Path(__file__).resolve().parents[2] / "../shared/traces").resolve()


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _row(ms: int, inp: int, out: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ms, "input_length": inp, "output_length": out, "hash_ids": ids}


def test_hits_from_prefix_chains(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        [
            _row(0, 1500, 10, [1, 2, 3]),  # new session 0
            _row(500, 2000, 5, [1, 2, 3, 4]),  # extends request 0: 3 blocks hit
            _row(1000, 1100, 7, [1, 9, 3]),  # only block 1 hits; block 3 is a different chain
            _row(1500, 1024, 3, [1, 2]),  # all hit but capped at input - 1 then rounded down
            _row(2500, 600, 2, [7, 8]),  # nothing seen: new session
        ],
    )
    got = load_mooncake(trace, block_tokens=64)
    assert [r.hit_tokens for r in got] == [0, 1536, 512, 960, 0]
    assert [r.timestamp_s for r in got] == [0.0, 0.5, 1.0, 1.5, 2.5]
    assert [r.prompt_tokens for r in got] == [1500, 2000, 1100, 1024, 600]
    assert [r.output_tokens for r in got] == [10, 5, 7, 3, 2]
    assert got[0] == TraceRequest(0.0, 1500, 0, 10, 0)


def test_hits_round_down_to_block_tokens(tmp_path: Path) -> None:
    trace = _write(tmp_path / "t.jsonl", [_row(0, 700, 1, [1, 2]), _row(1, 700, 1, [1, 2])])
    # two blocks seen = 1024 tokens, capped at 699, rounded down to 600 with 100-token blocks
    assert load_mooncake(trace, block_tokens=100)[1].hit_tokens == 600


def test_sessions_follow_requests_that_extend_a_whole_prompt(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl",
        [
            _row(0, 1024, 1, [0, 1]),  # A turn 1: session 0, owns node [0, 1]
            _row(0, 1024, 1, [0, 2]),  # B turn 1: shares only the system block 0 → session 1
            _row(1, 2048, 1, [0, 1, 3, 4]),  # A turn 2 → session 0
            _row(2, 1600, 1, [0, 2, 5, 6]),  # B turn 2 → session 1; last block partial
            _row(3, 3000, 1, [0, 2, 5, 6, 7, 8]),  # B turn 3: extends B turn 2's full blocks
            _row(4, 600, 1, [0, 9]),  # shares block 0 only → new session 2
        ],
    )
    assert [r.session_id for r in load_mooncake(trace, 64)] == [0, 1, 0, 1, 1, 2]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 5, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "input_length",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": [1]}',
            "output_length",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps(_row(0, 10, 1, [1])) + "\n\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_mooncake(trace, 64)
    assert f"{trace}:3:" in str(info.value)


def test_decreasing_timestamp_is_rejected(tmp_path: Path) -> None:
    trace = _write(tmp_path / "t.jsonl", [_row(5, 10, 1, [1]), _row(4, 10, 1, [2])])
    with pytest.raises(ValueError, match=r"t\.jsonl:2: 'timestamp' decreases"):
        load_mooncake(trace, 64)


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"shared traces folder absent: {TRACES}")
@pytest.mark.parametrize(
    ("name", "num_requests", "hit_ratio"),
    [
        ("mooncake_conversation_trace.jsonl", 12_031, 0.374),
        ("mooncake_synthetic_trace.jsonl", 3_993, 0.651),
    ],
)
def test_shared_traces(name: str, num_requests: int, hit_ratio: float) -> None:
    reqs = load_mooncake(TRACES / name, block_tokens=64)
    assert len(reqs) == num_requests
    ratio = sum(r.hit_tokens for r in reqs) / sum(r.prompt_tokens for r in reqs)
    assert ratio == pytest.approx(hit_ratio, abs=0.001)
    assert all(a.timestamp_s <= b.timestamp_s for a, b in itertools.pairwise(reqs))
    assert all(r.hit_tokens % 64 == 0 and r.hit_tokens < r.prompt_tokens for r in reqs)
    sessions = sorted({r.session_id for r in reqs})
    assert sessions == list(range(len(sessions)))  # dense ids in order of first appearance
    assert 1 < len(sessions) < num_requests  # multi-turn sessions exist, not one giant session
