"""Static import graph of ``src/dualpath`` (AST only, nothing imported), for the layer, circle
and torch-freeness tests.

``imports_of(path)`` names every module a file imports, at any depth (lazy imports in
functions and ``TYPE_CHECKING`` blocks included: a circle through them is still a circle);
``executed=True`` keeps only what importing the file runs (module and class bodies, not
functions, not ``if TYPE_CHECKING:``). ``from pkg import name`` names ``pkg.name`` when that is
a module, else ``pkg``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name → its file, for every module under ``src``."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST, executed: bool) -> Iterator[ast.AST]:
    if not executed:
        yield from ast.walk(tree)
        return
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(path: Path, known: Iterable[str] = (), executed: bool = False) -> list[str]:
    """Modules ``path`` imports (absolute imports; the package of a relative one is not
    resolved: the code base uses none). ``known``: module names that ``from X import y`` may
    name as ``X.y``."""
    names = set(known)
    found: list[str] = []
    for node in _nodes(ast.parse(path.read_text(), filename=str(path)), executed):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found.extend(s for s in subs if s in names)
            if any(s not in names for s in subs):
                found.append(node.module)
    return found


def _owner(module: str, files: dict[str, Path]) -> str | None:
    """The deepest module of ``files`` that ``module`` is or lies in (None: not ours)."""
    while module and module not in files:
        module = module.rpartition(".")[0]
    return module or None


def graph(files: dict[str, Path], executed: bool = False) -> dict[str, set[str]]:
    """Module → the modules of ``files`` it imports (itself left out)."""
    out = {}
    for name, path in files.items():
        deps = {_owner(m, files) for m in imports_of(path, files, executed)}
        out[name] = {d for d in deps if d is not None and d != name}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``g``: its strongly connected components of more than one
    module (Tarjan, iterative), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def executed_closure(paths: Iterable[Path], files: dict[str, Path]) -> set[str]:
    """Every module that importing ``paths`` runs: ours (each with its parent packages) and
    the top-level names of the others."""
    seen: set[str] = set()
    todo = [m for p in paths for m in imports_of(p, files, executed=True)]
    while todo:
        module = todo.pop()
        own = _owner(module, files)
        if own is None:
            seen.add(module.split(".")[0])
            continue
        parts = own.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            name = ".".join(parts[:i])
            if name in files and name not in seen:
                seen.add(name)
                todo.extend(imports_of(files[name], files, executed=True))
    return seen
