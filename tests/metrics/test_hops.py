"""The opt-in hop stamps (``metrics/hops.py``): off by default, one merged timeline when on."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.metrics import hops


def test_hops_are_off_unless_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hops.ENV, raising=False)
    importlib.reload(hops)
    monkeypatch.chdir(tmp_path)
    hops.hop("http.request", 1)
    assert not hops.enabled() and list(tmp_path.iterdir()) == []


def test_stamps_of_several_processes_merge_in_time_order(tmp_path: Path) -> None:
    code = "from dualpath.metrics.hops import hop; import sys; hop(sys.argv[1], int(sys.argv[2]))"
    env = {**os.environ, hops.ENV: str(tmp_path)}
    for name, rid in (("http.request", -1), ("sched.submit", 7), ("pe.pass", 7)):
        subprocess.run(
            [sys.executable, "-c", code, name, str(rid)], env=env, check=True, timeout=60
        )
    stamps = hops.read(str(tmp_path))
    assert [(n, r) for _, n, r in stamps] == [
        ("http.request", -1),
        ("sched.submit", 7),
        ("pe.pass", 7),
    ]
    assert len(list(tmp_path.glob("hops-*.txt"))) == 3  # one file per process
    assert stamps == sorted(stamps)
