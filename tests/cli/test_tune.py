"""`dualpath tune`: candidate split by the planner, ranking, cache reuse, one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.cli.tune_cmd import Candidate, candidates
from dualpath.config import load_toml, preset
from dualpath.models.planner import plan


def test_candidates_split_by_the_planner_range() -> None:
    config = preset("ds27b-1p1d")  # g = 8, s = 1: 1/7 <= P/D <= 7/2
    inside, outside = candidates(config, 9, search_ep=False)
    assert [c.label for c in outside] == ["1P8D", "8P1D"]  # 1/8 < 1/7 and 8 > 7/2
    assert [c.label for c in inside] == [f"{p}P{9 - p}D" for p in range(2, 8)]
    assert all(plan(config, c.p, c.d).in_range for c in inside)


def test_ep_search_adds_every_divisor_grouping() -> None:
    inside, _ = candidates(preset("ds27b-1p1d"), 4, search_ep=True)
    two_two = [c for c in inside if (c.p, c.d) == (2, 2)]
    assert {(c.prefill_ep_nodes, c.decode_ep_nodes) for c in two_two} == {
        (0, 0),
        (1, 1),
        (1, 2),
        (2, 1),
    }
    assert Candidate(2, 2, 1, 2).overrides()[2:] == [
        "cluster.prefill_ep_nodes=1",
        "cluster.decode_ep_nodes=2",
    ]


@pytest.mark.slow
def test_tune_ranks_simulates_once_and_reuses_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "tune",
        "--preset",
        "ds27b-1p1d",
        "--nodes",
        "3",
        "--agents",
        "8",
        "--mal",
        "32k",
        "--workers",
        "1",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "2 shapes, 2 simulated, 0 from cache" in first
    data = json.loads((tmp_path / "tune.json").read_text())
    jcts = [r["result"]["jct_s"] for r in data["ranked"]]
    assert jcts == sorted(jcts) and len(jcts) == 2
    assert first.count("best: " + data["best"]) == 1
    assert (tmp_path / "tune.png").stat().st_size > 0
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "2 shapes, 0 simulated, 2 from cache" in second
    assert json.loads((tmp_path / "tune.json").read_text())["ranked"] == data["ranked"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--nodes", "1"], "--nodes=1"),
        (["--nodes", "3", "--workers", "0"], "--workers=0"),
        (["--nodes", "3", "--aps", "inf"], "--aps=inf"),
        (["--nodes", "3", "--set", "cluster.num_prefill_nodes=x"], "cluster.num_prefill_nodes"),
    ],
)
def test_bad_input_is_one_line(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", "--preset", "ds27b-1p1d", "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--snic-mb-per-s", "inf"], "--snic-mb-per-s inf"),
        (["--agents", "0"], "--agents 0"),
        (["--systems", " "], "--systems is empty"),
        (["--background-load", "-1"], "--background-load -1"),
    ],
)
def test_validate_bad_input_is_one_line(
    extra: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.slow
@pytest.mark.runtime
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gpu_time", ["emulated", "host"])
def test_validate_runs_and_writes_a_preset_the_simulator_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], gpu_time: str
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    args = [
        "validate",
        "--out",
        str(out),
        "--kv-root",
        str(tmp_path / "kv"),
        "--no-progress",
        "--gpu-time",
        gpu_time,
        "--agents",
        "2",
        "--turns",
        "2",
        "--max-gen",
        "3",
        "--systems",
        "dualpath",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "JCT error: worst" in text and "prefill rt" in text
    payload = json.loads((out / "validate.json").read_text())
    assert [r["system"] for r in payload["rows"]] == ["dualpath"]
    for r in payload["rows"]:
        assert r["runtime_jct_s"] > 0 and r["sim_jct_s"] > 0
        assert math.isfinite(r["err_jct"])
        assert r["runtime_read_s"] >= 0 and r["sim_prefill_s"] > 0
    # the written preset is a valid config the simulator takes as it is
    hw = load_toml(out / "hardware.toml", base=preset("tiny-1p1d")).hardware
    assert hw.hbm_bytes_per_s == payload["hardware"]["hbm_bytes_per_s"]
    if gpu_time == "host":  # calibrated on this host
        assert hw.name.endswith("-calibrated") and 0 < hw.kv_read_efficiency <= 1
        return
    # emulated: the simulator runs the runtime's own preset, and the overruns are reported
    assert hw == preset("tiny-testbed").hardware
    assert "emulated GPU time, passes overrun: pe" in text
    engines = payload["gpu_overrun_share"]["dualpath"]
    assert any(e.startswith("pe") for e in engines) and any(e.startswith("de") for e in engines)
