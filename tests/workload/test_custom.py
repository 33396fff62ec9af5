"""Workloads of one's own (workload/custom.py): JSONL trajectories and TOML distributions
drive the simulator; every mistake in a file is one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

import dualpath
from dualpath.cli.main import main
from dualpath.config import apply_overrides, preset
from dualpath.config.loader import model_swap_note
from dualpath.workload import synthesize

DISTS = """
[turns]
dist = "constant"
value = 5
[first_append]
dist = "uniform"
low = 1000
high = 2000
[append]
dist = "lognormal"
mean = 300
sigma = 0.5
[generation]
dist = "constant"
value = 40
"""


def test_jsonl_trajectories_are_the_base_set_and_replicate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"turns": [[1000, 50], [200, 30]]}\n\n{"turns": [{"append_tokens": 700, "gen_tokens": 9}]}\n'
    )
    cfg = apply_overrides(
        preset("ds27b-1p1d"), [f"workload.trajectories={path}", "workload.num_agents=3"]
    )
    trajs = synthesize(cfg.workload, 64)
    assert [(t.append_tokens, t.gen_tokens) for t in trajs[0].turns] == [(1000, 50), (200, 30)]
    assert [(t.append_tokens, t.gen_tokens) for t in trajs[1].turns] == [(700, 9)]
    assert trajs[2].turns[1:] == trajs[0].turns and trajs[2].turns[0].gen_tokens == 1  # replica
    run = dualpath.simulate(cfg, "basic,dualpath")
    assert run["basic"].num_turns == 2 + 1 + 3
    assert sorted(r.prompt_tokens for r in run["basic"].records if r.agent_id == 0) == [1000, 1250]


def test_toml_distributions_drive_a_seeded_workload(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text(DISTS)
    cfg = apply_overrides(
        preset("ds27b-1p1d"), [f"workload.distributions={path}", "workload.num_agents=6"]
    )
    trajs = synthesize(cfg.workload, 64)
    assert trajs == synthesize(cfg.workload, 64)  # seeded
    assert all(t.num_turns == 5 for t in trajs)
    assert all(1000 <= t.turns[0].append_tokens <= 2000 for t in trajs)
    assert all(x.gen_tokens == 40 for t in trajs for x in t.turns)
    other = synthesize(apply_overrides(cfg, ["workload.seed=1"]).workload, 64)
    assert other != trajs
    assert dualpath.simulate(cfg, "dualpath")["dualpath"].num_turns == 30


def _sim_argv(tmp_path: Path) -> list[str]:
    """A small `dualpath sim` command line (its output under ``tmp_path``)."""
    return [
        "sim",
        "--preset",
        "ds27b-1p1d",
        "--agents",
        "2",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            '{"turns": [[1, 0]]}',
            "t.jsonl:1 turn 0: gen_tokens=0 is invalid: must be an integer >= 1",
        ),
        ('{"turns": []}', 't.jsonl:1: "turns" must be a non-empty list'),
        ("[1, 2]", 't.jsonl:1: each line must be an object with a "turns" list'),
        ('{"turns": [[1, 2]]}\n{oops', "t.jsonl:2: not JSON"),
        ('{"turns": [[1, 2, 3]]}', "t.jsonl:1 turn 0: a turn must be [append, gen]"),
        ("\n", "holds no trajectory"),
    ],
)
def test_bad_jsonl_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    (tmp_path / "t.jsonl").write_text(text)
    argv = _sim_argv(tmp_path)
    assert main([*argv, "--set", f"workload.trajectories={tmp_path / 't.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("value = 5", "value = -5"), "[turns] value=-5 is invalid: must be > 0"),
        (('dist = "uniform"', 'dist = "zipf"'), "[first_append] dist='zipf' is invalid"),
        (("sigma = 0.5", "sigma = 0.5\nshape = 2"), "[append] has unknown key 'shape'"),
        (("[generation]", "[gen]"), "unknown table [gen]"),
        (("low = 1000", "low = 3000"), "[first_append] low=3000, high=2000: need 0 < low <= high"),
        (("mean = 300", 'mean = "x"'), "[append] mean='x' is invalid: must be a finite number"),
        (("[turns]", "[turns"), "is not valid TOML"),
    ],
)
def test_bad_distributions_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], needle: str
) -> None:
    (tmp_path / "d.toml").write_text(DISTS.replace(*edit, 1))
    argv = _sim_argv(tmp_path)
    assert main([*argv, "--set", f"workload.distributions={tmp_path / 'd.toml'}"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_one_source_of_trajectories_and_missing_files(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        ValueError, match=r"workload\.trajectories=.a. is invalid: must be empty when"
    ):
        apply_overrides(preset(), ["workload.trajectories=a", "workload.distributions=b"])
    assert main(["sim", "--agents", "2", "--set", "workload.trajectories=/nonexistent.jsonl"]) == 2
    assert "workload.trajectories='/nonexistent.jsonl' cannot be read" in capsys.readouterr().err


def test_model_swap_resets_ep_and_says_what_it_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    base = preset("ds660b-2p4d")
    dense = apply_overrides(base, ["model=qwen32b"])
    assert (dense.cluster.prefill_ep, dense.cluster.decode_ep) == (False, False)
    moe = apply_overrides(dense, ["model=ds27b"])
    assert (moe.cluster.prefill_ep, moe.cluster.decode_ep) == (True, True)
    kept = apply_overrides(base, ["model=qwen32b", "cluster.prefill_ep=true"])
    assert kept.cluster.prefill_ep is True  # a later --set wins
    note = model_swap_note(base, dense)
    assert "set to false" in note and "kept: the hardware" in note and "2P4D" in note
    assert model_swap_note(base, base) == ""
