"""The peers study (``dualpath.api.peers``, ``dualpath peers``): its tables, verdicts, sweeps
and files, on a small storage-bound setup."""

from __future__ import annotations

import json
from pathlib import Path

from dualpath.api.peers import PEERS, binding_resource, compare_peers
from dualpath.cli.main import main

SMALL = ("hardware.snic_bytes_per_s=2e9", "workload.num_base_trajectories=8")


def test_study_tables_verdicts_and_files(tmp_path: Path) -> None:
    study = compare_peers(
        ("ds27b-1p1d",),
        agents=(8,),
        mals=("32k",),
        tier_bytes=(0.0, 1e9),
        ttls_s=(0.0, 480.0),
        overrides=SMALL,
        cache="off",
    )
    rows = study.main_rows()
    systems = [r["system"] for r in rows]
    assert systems[0] == "basic" and systems[-1] == "oracle" and "d2p" in systems
    by = {r["system"]: r for r in rows}
    assert by["basic"]["speedup_vs_basic"] == 1.0
    assert by["both-read"]["storage_read_tb"] == 2 * by["basic"]["storage_read_tb"]
    assert by["recompute"]["storage_read_tb"] == 0.0
    assert by["basic"]["binding"] == "PE SNIC read"  # 2 GB/s SNICs: storage-bound
    (v,) = study.verdicts()
    best = min(PEERS, key=lambda n: by[n]["jct_s"])
    assert v["best_peer"] == best
    assert v["dualpath_vs_best_peer"] == by[best]["jct_s"] / by["dualpath"]["jct_s"]
    # a 0-byte tier reads what Basic reads; a TTL of 0 holds nothing
    tiers = {(r["system"], r["point"]): r for r in study.sweep_rows("tiers")}
    assert tiers[("dram-tier", "0")]["jct_s"] == by["basic"]["jct_s"]
    ttls = {(r["system"], r["point"]): r for r in study.sweep_rows("ttls")}
    assert ttls[("d2p", "0")]["jct_s"] == by["basic"]["jct_s"]
    files = study.write(tmp_path)
    assert {f.name for f in files} == {
        "report.md",
        "peers.json",
        "peers.csv",
        "peers_jct.png",
        "peers_tiers.png",
        "peers_ttls.png",
    }
    assert all(f.stat().st_size > 0 for f in files)
    report = (tmp_path / "report.md").read_text()
    assert "## DRAM per node" in report and "## d2p TTL" in report and f"best peer {best}" in report
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["verdicts"][0]["best_peer"] == best


def test_binding_falls_back_to_decode_or_waits_when_nothing_is_busy(tmp_path: Path) -> None:
    study = compare_peers(
        ("ds27b-1p1d",),
        agents=(2,),
        mals=("32k",),
        systems=("basic",),
        tier_bytes=(),
        ttls_s=(),
        cache="off",
    )
    name, load = binding_resource(study.main.points[0].simulation.results["basic"])
    assert name == "decode / waits" and load < 0.5


def test_cli_peers_runs_and_names_a_bad_system(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["peers", "--presets", "ds27b-1p1d", "--agents", "2", "--mal", "32k", "--no-sweeps"]
    args += ["--systems", "basic,dram-tier", "--no-cache", "--no-progress", "--workers", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert "| ds27b-1p1d/32k/2 | dram-tier |" in capsys.readouterr().out
    assert (tmp_path / "report.md").exists()
    bad = ["peers", "--systems", "basic,lmcache", "--no-cache", "--out", str(tmp_path)]
    assert main(bad) != 0
    assert "system 'lmcache' is unknown" in capsys.readouterr().err
