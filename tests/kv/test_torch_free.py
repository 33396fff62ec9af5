"""The KV machinery (NIC pacer, slot buffer, KV stores, DRAM tier) needs no torch: importing
its tests runs no module of the runtime extra, the transports' numpy aside (a static check of
what each import executes)."""

from __future__ import annotations

from pathlib import Path

from tests.imports import executed_closure, module_files

from .conftest import NEED_NUMPY

HERE = Path(__file__).resolve().parent
HEAVY = {"torch", "numpy", "llguidance", "transformers", "ray"}  # the runtime extra's


def test_kv_tests_import_no_torch() -> None:
    tests = sorted(HERE.glob("test_*.py"))
    assert len(tests) >= 8
    for test in tests:
        ran = executed_closure([HERE / "conftest.py", test], module_files())
        allowed = {"numpy"} if test.name in NEED_NUMPY else set()
        assert sorted(ran & HEAVY - allowed) == [], test.name
    ran = executed_closure(tests, module_files())
    assert {"dualpath.kv.pacer", "dualpath.kv.buffer", "dualpath.kv.store"} <= ran


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
