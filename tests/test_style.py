"""The formatter decides the layout: no opt-out comments (the fmt skip and fmt off markers)
anywhere, and `ruff format --check` passes on the whole tree (pyproject.toml: line length 100)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "tests", "benchmarks", "scripts")
OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_no_formatter_opt_outs() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OPT_OUT.search(line) and path != Path(__file__).resolve()
    ]
    assert not found, f"formatter opt-outs (let `ruff format` decide): {found}"


def test_ruff_format_check_passes() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (the dev extra has it)")
    trees = [t for t in TREES if (ROOT / t).is_dir()]
    done = subprocess.run(
        [exe, "format", "--check", *trees], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
