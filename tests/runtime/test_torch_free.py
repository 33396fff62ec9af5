"""The pure runtime modules (NIC pacer, slot buffer, KV store) need no torch: importing their
tests runs no module that imports torch (a static check of what each import executes)."""

from __future__ import annotations

from pathlib import Path

from tests.imports import executed_closure, module_files

from .conftest import TORCH_FREE

HERE = Path(__file__).resolve().parent
HEAVY = {"torch", "numpy", "llguidance", "transformers", "ray"}  # the runtime extra's


def test_pure_runtime_tests_import_no_torch() -> None:
    tests = [HERE / name for name in TORCH_FREE if name != Path(__file__).name]
    assert tests and all(p.is_file() for p in tests)
    ran = executed_closure([HERE / "conftest.py", *tests], module_files())
    assert {"dualpath.kv.pacer", "dualpath.kv.buffer", "dualpath.kv.store"} <= ran
    assert sorted(ran & HEAVY) == []


def test_the_check_sees_an_import_through_a_package(tmp_path: Path) -> None:
    """Guards against a vacuous check: torch two modules away, behind a package ``__init__``."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg import heavy\n")
    (tmp_path / "pkg" / "heavy.py").write_text("import torch\n")
    (tmp_path / "pkg" / "light.py").write_text("def f():\n    import numpy\n")
    test = tmp_path / "test_x.py"
    test.write_text("from pkg.light import f\n")
    ran = executed_closure([test], module_files(tmp_path))
    assert "torch" in ran and "numpy" not in ran  # (a lazy import runs only when called)
