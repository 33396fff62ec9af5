"""Imports point down the layer stack only; sim and runtime never reach each other, nor the
vLLM integration and the runtime, through any chain of imports (lazy ones included); no
import circle; the policy core touches no clock, sockets, processes or torch."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest
from tests.imports import cycles, graph, module_files

SRC = Path(__file__).resolve().parents[1] / "src" / "dualpath"

RANK = {
    "types": 0,
    "units": 0,
    "progress": 0,
    "net": 0,
    "tokens": 0,
    "config": 1,
    "models": 2,
    "workload": 2,
    "metrics": 2,
    "deploy": 2,
    "policy": 3,
    "ledger": 4,
    "kv": 4,  # the KV machinery every shell shares: store, buffers, pacers, transports
    "frontend": 4,  # the engine-neutral OpenAI protocol both servers speak
    "sim": 5,
    "runtime": 5,
    "serve": 6,  # our runtime's server
    "integrations": 6,
    "api": 6,
    "cli": 7,
}
# layers that never reach each other, whatever the chain: what two of them share lives lower
APART = ({"sim", "runtime"}, {"integrations", "runtime"}, {"integrations", "serve"})
POLICY_FORBIDDEN = {"time", "datetime", "socket", "torch", "multiprocessing", "threading", "zmq"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dualpath":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _chain(g: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches in ``g`` → the module it is imported from on a
    shortest chain (breadth first, in sorted order: the same chain every run)."""
    parent: dict[str, str] = {}
    todo = deque([start])
    while todo:
        m = todo.popleft()
        for d in sorted(g.get(m, ())):
            if d != start and d not in parent:
                parent[d] = m
                todo.append(d)
    return parent


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    """What breaks the layer rules in the import graph ``g`` (module → modules it imports):
    a module of an unknown layer, a chain that points up, or one that joins two layers that
    stay ``APART``, each named with its chain of imports."""
    out = []
    for start in sorted(g):
        own = _layer(start)
        if own in (None, "__init__"):
            continue
        if own not in RANK:
            out.append(f"{start}: layer {own!r} is not in the layer table")
            continue
        parent = _chain(g, start)
        for reached in sorted(parent):
            target = _layer(reached)
            if target in (None, "__init__", own):
                continue
            bad = target not in RANK or RANK[target] > RANK[own] or {own, target} in APART
            if not bad:
                continue
            chain = [reached]
            while chain[-1] != start:
                chain.append(parent[chain[-1]])
            out.append(" -> ".join(reversed(chain)))
    return out


def test_no_import_chain_breaks_the_layers() -> None:
    """Direct and through any chain (lazy imports and ``TYPE_CHECKING`` ones count): importing
    the vLLM router's app never loads the runtime, nor the runtime the simulator."""
    g = graph(module_files())
    assert len(g) > 200
    assert layer_violations(g) == []


def test_the_layer_check_finds_a_chain(tmp_path: Path) -> None:
    """The checker itself fails on an import that points up, and on two layers kept apart
    that meet only through a third (integrations -> serve's server -> runtime)."""
    pkg = tmp_path / "dualpath"
    for sub in ("integrations", "serve", "runtime", "policy", "sim"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "integrations" / "app.py").write_text(
        "def f():\n    from dualpath.integrations import router\n"  # a lazy import counts
    )
    (pkg / "integrations" / "router.py").write_text("from dualpath.serve import server\n")
    (pkg / "serve" / "server.py").write_text("from dualpath.runtime.session import Runtime\n")
    (pkg / "runtime" / "session.py").write_text("class Runtime: ...\n")
    (pkg / "policy" / "rule.py").write_text("from dualpath.sim.events import EventLoop\n")
    (pkg / "sim" / "events.py").write_text("class EventLoop: ...\n")
    (pkg / "oddity.py").write_text("")
    found = layer_violations(graph(module_files(tmp_path)))
    app, router = "dualpath.integrations.app", "dualpath.integrations.router"
    server, session = "dualpath.serve.server", "dualpath.runtime.session"
    assert found == [
        f"{app} -> {router} -> {server} -> {session}",
        f"{app} -> {router} -> {server}",
        f"{router} -> {server} -> {session}",
        f"{router} -> {server}",
        "dualpath.oddity: layer 'oddity' is not in the layer table",
        "dualpath.policy.rule -> dualpath.sim.events",
    ]


@pytest.mark.parametrize("layer", ["policy", "ledger"])
def test_core_layers_are_pure(layer: str) -> None:
    paths = sorted((SRC / layer).rglob("*.py"))
    assert paths, f"no modules under {layer}/"
    for path in paths:
        for module in _imports(path):
            assert module.split(".")[0] not in POLICY_FORBIDDEN, f"{path} imports {module}"


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


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
