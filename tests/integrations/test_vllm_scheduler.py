"""The connector under a real vLLM ``Scheduler``: runs ``tests/integrations/vllm_inside`` with
vLLM's own Python (``.venv-vllm``, where ``make test`` installs vLLM and pytest) on a tiny
local checkpoint. Those cases drive admission, chunked prefill, preemption, aborts before
and after a load, and a load whose lease is gone, and check after every step that no page
of a running request holds stale KV (``vllm_inside/test_connector_lifecycle.py``)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.integrations.nodes import vllm_python

REPO = Path(__file__).resolve().parents[2]
INSIDE = Path(__file__).parent / "vllm_inside"
pytestmark = [pytest.mark.timeout(600)]


def test_connector_lifecycle_under_a_real_vllm_scheduler(tmp_path: Path) -> None:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    python = vllm_python()
    ckpt = tmp_path / "tiny"
    write_tiny_checkpoint(
        ckpt, num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256
    )
    env = {
        **os.environ,
        "DUALPATH_TINY_CKPT": str(ckpt),
        "VLLM_LOGGING_LEVEL": "ERROR",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p
        ),
    }
    got = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "inside"),
            str(INSIDE),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = (got.stdout + got.stderr)[-4000:]
    assert got.returncode == 0, tail
    assert re.search(r"^5 passed", got.stdout, re.M), tail  # all ran, none skipped
