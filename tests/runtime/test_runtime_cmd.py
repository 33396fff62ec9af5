"""`dualpath bench --runtime local`: argument errors (a missing transport library too) and one
small real run."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dualpath.cli.main import main

pytest.importorskip("torch")


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--runtime", "cluster"]) == 2
    assert "--runtime 'cluster' is invalid" in capsys.readouterr().err
    assert main(["bench", "--systems", "basic,turbo", "--agents", "1", "--turns", "1"]) == 2
    assert "system='turbo' is invalid" in capsys.readouterr().err
    rc = main(
        [
            "bench",
            "--runtime",
            "local",
            "--agents",
            "1",
            "--turns",
            "1",
            "--no-progress",
            "--set",
            "scheduler.split_reads=true",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "split_reads=true is not supported by the runtime" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_missing_mooncake_is_one_line_and_starts_nothing(
    runtime: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("mooncake", "mooncake.engine"):  # imports fail, as where it is not installed
        monkeypatch.setitem(sys.modules, name, None)

    def started(*_: object) -> None:
        raise AssertionError("got past the transport check")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)
    monkeypatch.setattr("dualpath.cli.runtime_cmd.check_kv_root", started)
    argv = [
        "bench",
        "--runtime",
        runtime,
        "--transport",
        "mooncake",
        "--agents",
        "1",
        "--turns",
        "1",
        "--no-progress",
        "--kv-root",
        str(tmp_path / "kv"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dualpath: error: --transport mooncake needs the Mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in err and "'mooncake' extra" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "kv").exists()


@pytest.mark.slow
def test_small_bench_run_reports_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--runtime",
            "local",
            "--agents",
            "2",
            "--turns",
            "2",
            "--systems",
            "basic,oracle",
            "--token-scale",
            "0.1",
            "--max-gen",
            "3",
            "--kv-root",
            str(tmp_path / "kv"),
            "--no-progress",
            "--json",
            str(out),
            "--set",
            "hardware.gpus_per_node=1",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "oracle" in text and "SNIC utilisation" in text and "JCT basic / oracle" in text
    assert "emulated GPU time, passes overrun: pe0@node0" in text  # the default: emulated
    data = json.loads(out.read_text())
    assert set(data["basic"]["gpu_overrun_share"]) == {"pe0@node0", "de1@node1"}
    assert data["basic"]["num_turns"] == data["oracle"]["num_turns"] == 4
    assert data["basic"]["bytes_by_path"]["de_to_storage"] > 0
    assert (
        data["basic"]["bytes_by_path"]["storage_to_de_buffer"] == 0
    )  # Basic reads on the PE side only
    assert data["oracle"]["snic_aggregate_utilisation"] is None  # unpaced: no figure
    assert not list((tmp_path / "kv").iterdir())  # per-system stores are removed


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """SIGINT to the CLI mid-run: exit 130 and no process of the run survives."""
    tag = f"dualpath-test-{uuid.uuid4().hex}"
    env = {**os.environ, "DUALPATH_TEST_TAG": tag}
    # long enough (40 turns at 2 MB/s per SNIC) that it cannot finish before the SIGINT,
    # however slow or loaded the host: it is interrupted, never run to the end
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli.main",
        "bench",
        "--agents",
        "4",
        "--turns",
        "40",
        "--snic-mb-per-s",
        "2",
        "--systems",
        "basic",
        "--kv-root",
        str(tmp_path),
        "--set",
        "hardware.gpus_per_node=1",
    ]
    # the child starts with SIGINT at its default whatever this process inherited (a shell's
    # background job, e.g. `make test &`, ignores SIGINT, and a child inherits that)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 60
    while len(_tagged(tag)) < 5 and time.monotonic() < deadline:  # parent + 4 children
        time.sleep(0.2)
    # mid-run: the first turn's blocks are in the store (not a guessed pause)
    while not any(tmp_path.rglob("*.kvb")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(tmp_path.rglob("*.kvb")), "the run persisted nothing within 60 s"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged(tag) == []


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if tag.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return sorted(found)
