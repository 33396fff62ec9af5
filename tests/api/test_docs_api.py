"""docs/api.md's examples run as written (top to bottom, one namespace, as a notebook), and
examples/bandwidth_sweep.py runs on a small batch and prints the table it documents."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"
EXAMPLE = ROOT / "examples" / "bandwidth_sweep.py"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_doc_has_examples() -> None:
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 6
    joined = "\n".join(blocks)
    for call in ("Config.from_preset", "simulate(", "sweep(", "plan(", "frame()", "turns_frame()"):
        assert call in joined, call


@pytest.mark.slow
def test_docs_api_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the doc's mkdtemp() calls
    namespace: dict[str, object] = {"__name__": "docs_api"}
    for i, block in enumerate(python_blocks(DOC.read_text())):
        exec(compile(block, f"docs/api.md block {i + 1}", "exec"), namespace)
    assert not (tmp_path / "runs").exists()  # the API writes no cache unless asked


def _load_example() -> object:
    spec = importlib.util.spec_from_file_location("bandwidth_sweep", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bandwidth_sweep_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = _load_example()
    out = tmp_path / "bw"
    cache = tmp_path / "cache"
    argv = ["--agents", "8", "--mal", "32k", "--workers", "1", "--cache", str(cache)]
    assert example.main([*argv, "--out", str(out)]) == 0  # type: ignore[attr-defined]
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if re.match(r"^\d+\.0 ", line)]
    assert [r[0] for r in rows] == ["100.0", "200.0", "400.0", "800.0"]
    for r in rows:  # basic, dualpath, oracle, speedup, of_oracle
        basic, dual, oracle, speedup = (float(x) for x in r[1:5])
        assert speedup == pytest.approx(basic / dual, abs=0.01)
        assert oracle <= dual  # the Oracle's transfers take no time
    assert "12 simulated, 0 from the cache" in printed
    assert (out / "bandwidth_sweep.png").stat().st_size > 0
    assert {"sweep.json", "sweep.csv", "sweep.png"} <= {p.name for p in out.iterdir()}
    assert example.main([*argv, "--out", str(tmp_path / "again")]) == 0  # type: ignore[attr-defined]
    assert "0 simulated, 12 from the cache" in capsys.readouterr().out
    assert (tmp_path / "again" / "sweep.csv").read_bytes() == (out / "sweep.csv").read_bytes()
