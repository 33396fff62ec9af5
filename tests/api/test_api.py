"""The public API (src/dualpath/api): results as tables, the shared result cache, sweeps over
any key, and one-line errors for bad input."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

import dualpath
from dualpath.api import Axis, as_config
from dualpath.api.frames import flatten
from dualpath.api.grid import parse_set
from dualpath.cli.main import main
from dualpath.progress import LineProgress, bar
from dualpath.sim.cache import ResultCache, cache_key, code_version

SMALL = ["workload.num_agents=4", "workload.mal=32k"]


def small() -> dualpath.Config:
    return dualpath.Config.from_preset("ds27b-1p1d", SMALL)


def test_lazy_exports_are_the_api() -> None:
    assert dualpath.simulate is dualpath.api.simulate
    assert dualpath.Config is dualpath.config.Config
    with pytest.raises(AttributeError, match="no attribute 'simulat'"):
        _ = dualpath.simulat  # type: ignore[attr-defined]


def test_simulation_rows_carry_every_metric() -> None:
    run = dualpath.simulate(small(), ["dualpath", "basic"])
    assert run.systems == ["basic", "dualpath"]  # design §11 order
    rows = run.rows()
    flat = flatten(run["basic"].to_dict())
    assert set(flat) - {"system"} <= set(rows[0])
    assert rows[0]["summary.ttst_s.mean"] == run["basic"].summary["ttst_s"]["mean"]
    assert rows[1]["speedup_vs_basic"] == pytest.approx(run.speedup("dualpath"))
    turns = run.turn_rows("dualpath")
    assert len(turns) == run["dualpath"].num_turns
    rec = run["dualpath"].records[0]
    assert turns[0]["ttft_s"] == rec.first_token_s - rec.arrival_s
    assert turns[0]["ttst_s"] == rec.second_token_s - rec.first_token_s


def test_cache_hits_are_bit_identical_and_keys_follow_the_config(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path)
    first = dualpath.simulate(small(), "basic", cache=cache)
    again = dualpath.simulate(small(), "basic", cache=cache)
    assert (first.from_cache, again.from_cache, cache.hits, cache.misses) == (0, 1, 1, 1)
    assert again["basic"].to_dict() == first["basic"].to_dict()
    assert again["basic"].records == first["basic"].records
    other = small().with_overrides("workload.seed=1")
    assert cache_key(other, "basic", "offline") != cache_key(small(), "basic", "offline")
    assert cache_key(small(), "dualpath", "offline") != cache_key(small(), "basic", "offline")
    trace = tmp_path / "t.jsonl"
    trace.write_text("a")
    with_trace = small().with_overrides(f"workload.trace={trace}")
    before = cache_key(with_trace, "basic", "offline")
    trace.write_text("b")  # same path, new content: a new key
    assert cache_key(with_trace, "basic", "offline") != before
    assert len(code_version()["source_sha256"]) == 16


def test_sweep_grid_rows_are_typed_and_ordered() -> None:
    grid = dualpath.sweep(
        small(),
        {"hardware.snic_bytes_per_s": [12.5e9, 50e9], "cluster.num_decode_nodes": [1, 2]},
        "basic",
    )
    rows = grid.rows()
    assert [(r["hardware.snic_bytes_per_s"], r["cluster.num_decode_nodes"]) for r in rows] == [
        (12.5e9, 1),
        (12.5e9, 2),
        (50e9, 1),
        (50e9, 2),
    ]
    assert rows[0]["point"] == "snic_bytes_per_s=12500000000/num_decode_nodes=1"
    assert grid.points[3].config.cluster.num_decode_nodes == 2
    assert grid.simulated == 4 and grid.from_cache == 0
    payload = grid.to_json()
    assert payload["run"]["seed"] == 0 and len(payload["points"]) == 4
    assert payload["points"][1]["config"]["cluster"]["num_decode_nodes"] == 2


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"hardware.snic_gbps": [1, 2]}, "unknown config key hardware.snic_gbps"),
        ({"cluster.num_decode_nodes": [1, "x"]}, "cluster.num_decode_nodes='x' is invalid"),
        ({"cluster.num_decode_nodes": []}, "has no values"),
        ({"cluster.num_decode_nodes": [2, 2]}, "repeats a value"),
        ({}, "the grid has no axis"),
    ],
)
def test_sweep_mistakes_are_one_line(grid: dict[str, list[object]], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        dualpath.sweep(small(), grid, "basic")
    assert "\n" not in str(err.value)


def test_parse_set_and_axes() -> None:
    assert parse_set("hardware.snic_bytes_per_s=12.5e9, 25e9") == (
        "hardware.snic_bytes_per_s",
        ["12.5e9", "25e9"],
    )
    assert parse_set("sim.systems=basic,dualpath") == ("sim.systems", ["basic,dualpath"])
    with pytest.raises(ValueError, match="an empty value"):
        parse_set("cluster.num_decode_nodes=1,,2")
    axis = Axis.of("model", ["qwen32b", "ds27b"])
    assert [c.overrides for c in axis.choices] == [("model=qwen32b",), ("model=ds27b",)]
    with pytest.raises(ValueError, match="give a Config or a preset name"):
        as_config(3)  # type: ignore[arg-type]


def test_cli_sweep_over_any_key_then_from_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "sweep",
        "--preset",
        "ds27b-1p1d",
        "--agents",
        "4",
        "--mal",
        "32k",
        "--set",
        "hardware.snic_bytes_per_s=12.5e9,25e9",
        "--set",
        "cluster.num_decode_nodes=1,2",
        "--set",
        "workload.seed=3",
        "--systems",
        "basic,dualpath",
        "--workers",
        "2",
        "--no-progress",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert "4 points x 2 systems: 8 simulated, 0 from the cache" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "8 from the cache" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "a" / "sweep.csv").open()))
    assert len(rows) == 8 and {"summary.ttst_s.p50", "counters.event_digest"} <= set(rows[0])
    assert rows[0]["point"] == "ds27b-1p1d/32k/4/snic_bytes_per_s=12.5e9/num_decode_nodes=1"
    assert (tmp_path / "a" / "sweep.csv").read_bytes() == (
        tmp_path / "b" / "sweep.csv"
    ).read_bytes()
    payload = json.loads((tmp_path / "a" / "sweep.json").read_text())
    assert {p["seed"] for p in payload["points"]} == {3}
    bad = [a.replace("=1,2", "=0,1") for a in args]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cluster.num_decode_nodes=0 is invalid" in err
    assert main([*args, "--set", "cluster.num_decode_nodes=3,4"]) == 2
    assert "the axis cluster.num_decode_nodes appears twice" in capsys.readouterr().err


def test_progress_in_a_log_is_one_line_per_step() -> None:
    log = io.StringIO()
    with bar(200, "sweep", "sim", stream=log) as p:
        assert isinstance(p, LineProgress)
        for _ in range(200):
            p.update(1)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 11 and lines[-1] == "sweep: 100% (200/200 sim)"
    silent = io.StringIO()
    with bar(5, "x", stream=silent, disable=True) as p:
        p.update(5)
    assert silent.getvalue() == ""
