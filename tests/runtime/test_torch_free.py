"""The pure runtime modules (NIC pacer, slot buffer, KV store) need no torch: their tests
pass in a fresh interpreter where importing torch fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TORCH_FREE

HERE = Path(__file__).resolve().parent

BLOCKED = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pure_runtime_modules_pass_their_tests_without_torch() -> None:
    files = [str(HERE / name) for name in TORCH_FREE if name != Path(__file__).name]
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, "-q", "-p", "no:cacheprovider", "-rs", *files],
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "error" not in summary, summary
