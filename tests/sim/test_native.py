"""The compiled simulator core (``dualpath.sim.native``) against the pure-Python reference:
the same event logs, results and records, byte for byte; and how a process picks its core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.sim import native

SRC = Path(__file__).resolve().parents[2] / "src"

# each run: its event-log digest, and a digest of its result (to_dict) and every record
RUNS_SCRIPT = """
import hashlib, json
from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim import native
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster

import dualpath.sim.rates as rates
out = {"core": native.core(), "rates_file": rates.__file__}
for name, system, agents in (
    ("ds660b-2p4d", "basic", 24),
    ("ds660b-2p4d", "dualpath", 24),
    ("ds660b-2p4d", "oracle", 8),
    ("ds27b-1p1d", "dualpath", 12),
):
    config = apply_overrides(preset(name), [f"workload.num_agents={agents}", "workload.mal=32k"])
    cluster = build_cluster(config, system, SimConfig())
    run_cluster(cluster)
    result = collect(cluster)
    body = json.dumps(result.to_dict(), sort_keys=True) + repr(result.records)
    out[f"{name}/{system}"] = [
        cluster.loop.log_digest(), hashlib.sha256(body.encode()).hexdigest(), len(result.records)
    ]
print(json.dumps(out))
"""


def _run(core: str, script: str = RUNS_SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DUALPATH_SIM_CORE": core, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow
def test_compiled_core_gives_the_pure_cores_event_logs_results_and_records() -> None:
    why = native.check()
    if why:
        pytest.skip(f"compiled simulator core {why}")
    pure, compiled = _run("python"), _run("native")
    assert pure.returncode == 0, pure.stderr
    assert compiled.returncode == 0, compiled.stderr
    a, b = json.loads(pure.stdout), json.loads(compiled.stdout)
    assert (a.pop("core"), b.pop("core")) == ("python", "native")
    assert a.pop("rates_file").endswith("rates.py")
    assert b.pop("rates_file").endswith(native._suffix())  # the compiled module really ran
    assert all(n > 0 for _, _, n in a.values())
    assert a == b


def test_a_bad_core_choice_is_one_line_naming_it() -> None:
    cli = "from dualpath.cli.main import main; raise SystemExit(main(['native', 'status']))"
    proc = _run("bogus", cli)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "dualpath: error: DUALPATH_SIM_CORE='bogus': must be one of auto, python, native"
    )
    proc = _run("python", cli)
    assert proc.returncode == 0
    assert proc.stdout.strip().endswith("this process runs: python")


def test_the_build_is_used_only_when_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "NATIVE_DIR", tmp_path)
    monkeypatch.setattr(native, "MANIFEST", tmp_path / "manifest.json")
    assert native.check() == "not built (make native)"
    digests = native._source_digests()
    manifest = {"suffix": native._suffix(), "sources": digests}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert native.check().startswith("incomplete build: admission, channel")
    for short in (*native.MODULES, f"{native.GROUP}__mypyc"):
        native._so_path(short).write_bytes(b"")
    assert native.check() == ""
    stale = {**digests, "rates": "0" * 64, "events": "1" * 64}
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "sources": stale}))
    assert native.check() == "stale: events, rates changed since the build (make native)"
    other = {**manifest, "suffix": ".cpython-99-x.so"}
    (tmp_path / "manifest.json").write_text(json.dumps(other))
    assert native.check().startswith("built for '.cpython-99-x.so'")
    (tmp_path / "manifest.json").write_text("{")
    assert native.check().startswith("unreadable manifest")


def test_every_simulator_module_is_compiled_or_named_as_left_out() -> None:
    """A new module of the simulator's hot path is compiled too (or named here, with why)."""
    left_out = {  # run once per simulation, drivers, processes, benchmark support, this one,
        # the result cache and the job list around whole simulations
        "__init__", "cache", "fanout", "flowreplay", "jobs", "native", "observe", "online",
        "plots", "report", "results", "runner", "studies", "trace_export",
    }  # fmt: skip
    modules = {p.stem for p in (SRC / "dualpath" / "sim").glob("*.py")}
    assert modules - left_out == set(native.MODULES)
