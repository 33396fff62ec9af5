"""`dualpath sim` / `dualpath sweep` (src/dualpath/cli/sim_cmd.py): outputs and user errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.cli.sim_cmd import default_out_dir
from dualpath.config import preset
from dualpath.config.sim import SimConfig

ARGS = ["--preset", "ds27b-1p1d", "--agents", "4", "--mal", "32k", "--no-progress"]


def test_sim_writes_outputs_deterministically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a"
    assert main(["sim", *ARGS, "--systems", "basic,oracle,dualpath", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "dualpath" in table and "JCT s" in table
    for name in ("config.json", "results.json", "results.csv", "jct.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "results.json").read_text())
    assert data["systems"] == ["basic", "dualpath", "oracle"]  # design §11 order
    assert data["comparisons"]["basic"]["speedup_vs_basic"] == 1.0
    assert data["comparisons"]["oracle"]["fraction_of_oracle"] == 1.0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["system"] for r in rows] == ["basic", "dualpath", "oracle"]
    config = json.loads((out / "config.json").read_text())
    assert config["config"]["workload"]["num_agents"] == 4
    assert config["sim"]["systems"] == "basic,dualpath,oracle"
    again = tmp_path / "b"
    assert main(["sim", *ARGS, "--systems", "basic,oracle,dualpath", "--out", str(again)]) == 0
    assert (again / "results.json").read_bytes() == (out / "results.json").read_bytes()


def test_sim_overrides_reach_sim_config(tmp_path: Path) -> None:
    out = tmp_path / "c"
    code = main(
        [
            "sim",
            *ARGS,
            "--systems",
            "dualpath",
            "--set",
            "sim.traffic_manager=false",
            "--set",
            "sim.decode_macro_steps=8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    sim = json.loads((out / "config.json").read_text())["sim"]
    assert sim["traffic_manager"] is False and sim["decode_macro_steps"] == 8


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--systems", "basic,warp"], "sim.systems"),
        (["--set", "sim.nope=1"], "sim.nope"),
        (["--set", "sim.reads_per_node=two"], "sim.reads_per_node"),
        (["--mal", "99k"], "workload.mal"),
        (["--agents", "0"], "workload.num_agents"),
        (["--set", "scheduler.policy=dpl"], "scheduler.policy='dpl' conflicts with system 'basic'"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["sim", *ARGS, *extra, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_default_out_dir_is_deterministic() -> None:
    config = preset("ds660b-2p4d")
    a = default_out_dir(config, SimConfig(), ["workload.seed=3"])
    assert a == default_out_dir(config, SimConfig(), ["workload.seed=3"])
    assert str(a).startswith("runs/sim-ds660b-2p4d-64k-64a-basic+dualpath+oracle-")
    assert a != default_out_dir(config, SimConfig(), [])


def test_sim_section_overrides_are_typed(tmp_path: Path) -> None:
    out = tmp_path / "d"
    code = main(
        [
            "sim",
            *ARGS,
            "--systems",
            "oracle",
            "--set",
            "sim.pull_interval_s=0.002",
            "--set",
            "sim.per_layer=yes",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["sim"]["pull_interval_s"] == 0.002 and config["sim"]["per_layer"] is True
    assert config["config"]["sim"] == config["sim"]


def test_sweep_grid_in_parallel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    code = main(
        [
            "sweep",
            "--preset",
            "ds27b-1p1d",
            "--pd",
            "1p1d,2p1d",
            "--mal",
            "32k",
            "--agents",
            "3",
            "--systems",
            "basic,dualpath",
            "--workers",
            "2",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["point"], r["system"]) for r in rows] == [
        ("ds27b-1p1d/1p1d/32k/3", "basic"),
        ("ds27b-1p1d/1p1d/32k/3", "dualpath"),
        ("ds27b-1p1d/2p1d/32k/3", "basic"),
        ("ds27b-1p1d/2p1d/32k/3", "dualpath"),
    ]
    assert (out / "sweep.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    assert main(["sweep", "--pd", "1x1", "--out", str(out)]) == 2
