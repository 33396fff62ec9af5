"""STYLE §2: imports point down the layer stack only; sim and runtime never import each other,
nor the vLLM integration and the runtime; no import circle; the policy core touches no clock,
sockets, processes or torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tests.imports import cycles, graph, module_files

SRC = Path(__file__).resolve().parents[1] / "src" / "dualpath"

RANK = {
    "types": 0,
    "units": 0,
    "progress": 0,
    "net": 0,
    "config": 1,
    "models": 2,
    "workload": 2,
    "metrics": 2,
    "deploy": 2,
    "policy": 3,
    "ledger": 4,
    "kv": 4,  # the KV machinery every shell shares: store, buffers, pacers, transports
    "sim": 5,
    "runtime": 5,
    "serve": 6,
    "integrations": 6,
    "api": 6,
    "cli": 7,
}
POLICY_FORBIDDEN = {"time", "datetime", "socket", "torch", "multiprocessing", "threading", "zmq"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dualpath":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py"))


def _own_layer(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    own = _own_layer(path)
    if own == "__init__":
        return
    assert own in RANK, f"{path}: layer {own!r} is not in the layer table (STYLE §2)"
    for module in _imports(path):
        target = _layer(module)
        if target is None or target == "__init__":
            continue
        assert target in RANK, f"{path} imports unknown layer {module}"
        assert RANK[target] <= RANK[own], f"{path} ({own}) imports {module} ({target}): points up"
        assert {own, target} != {"sim", "runtime"}, (
            f"{path}: sim and runtime never import each other"
        )
        assert {own, target} != {"integrations", "runtime"}, (
            f"{path}: the vLLM integration and the runtime never import each other "
            "(what they share lives in kv/)"
        )


@pytest.mark.parametrize("layer", ["policy", "ledger"])
def test_core_layers_are_pure(layer: str) -> None:
    paths = sorted((SRC / layer).rglob("*.py"))
    assert paths, f"no modules under {layer}/"
    for path in paths:
        for module in _imports(path):
            assert module.split(".")[0] not in POLICY_FORBIDDEN, f"{path} imports {module}"


def test_layer_table_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself must fail on a bad import (guards against a vacuous test)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from dualpath.sim.events import EventLoop\n")
    assert "dualpath.sim.events" in _imports(bad)
    assert RANK[_layer("dualpath.sim.events") or ""] > RANK["policy"]


def test_no_import_circle() -> None:
    """No module reaches itself through its imports: lazy imports in functions and
    ``TYPE_CHECKING`` blocks count (they only hide a circle from the interpreter)."""
    assert cycles(graph(module_files())) == []


def test_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """The checker itself fails on a circle, also one through a lazy or typing-only import."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    (pkg / "d.py").write_text("import pkg.a\n")  # reaches the circle, is not on it
    assert cycles(graph(module_files(tmp_path))) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert cycles(graph(module_files(tmp_path), executed=True)) == []  # what the interpreter sees


# what a shell may not touch: the ledger or the policy behind the core (``ledger.Core``)
AROUND_THE_CORE = {"ledger", "_ledger", "_policy", "num_waiting", "plan_forward", "schedule"}
SHELLS = ("sim", "runtime", "integrations")


def _reached_around(path: Path) -> list[str]:
    """Attributes of ``path`` that reach past the core: ``x.ledger``, ``x.policy.schedule``,
    ``policy.num_waiting`` and the like, or an import of ``Ledger``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in AROUND_THE_CORE:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "Ledger" for a in node.names):
            found.append(f"{path.name}:{node.lineno}: imports Ledger")
    return found


def test_the_shells_reach_the_ledger_and_the_policy_only_through_the_core() -> None:
    """Both shells submit, pull, plan and report through ``ledger.Core``: nothing of the
    ledger or the policy is reached around it (the core's ``ledger`` and ``policy`` are for
    tests and reports)."""
    files = [p for shell in SHELLS for p in sorted((SRC / shell).rglob("*.py"))]
    assert len(files) > 40
    found = [hit for p in files for hit in _reached_around(p)]
    assert not found, "reached around the core: " + "; ".join(found)


def test_reaching_around_the_core_is_found(tmp_path: Path) -> None:
    shell = tmp_path / "shell.py"
    shell.write_text(
        "from dualpath.ledger.ledger import Ledger\n"
        "def pull(core):\n    return core.ledger.pull(core.policy, 0.0)\n"
    )
    assert _reached_around(shell) == ["shell.py:1: imports Ledger", "shell.py:3: .ledger"]
