"""Every file and module the docs name exists: a path in docs/*.md or README.md (a file of this
repository, written from its root or from ``src/dualpath``) is a file here, and a backticked
module or object (``dualpath.kv.pacer.Pacer``, or ``kv.pacer.Pacer`` from the package) resolves
to a module of ``src/dualpath`` and a name defined there. Names are found statically (the
modules' syntax trees, imports followed), so nothing is imported. A ``config.x``, ``ledger.x``
or ``policy.x`` may name an instance's attribute (``Config``, ``Ledger``, ``PolicyCore``), and
``section.key`` a configuration key (``workload.num_agents``)."""

from __future__ import annotations

import ast
import re
from dataclasses import fields, is_dataclass
from functools import cache
from pathlib import Path

from dualpath.config import Config

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "dualpath"
DOCS = (*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md")

# a path-like word ending in one of these; output files (json, csv, png) are left alone
PATH = re.compile(r"(?<![\w/.<$~-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|toml))\b")
TICK = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
FILE_NAME = re.compile(r"\.(?:py|md|sh|toml|json|csv|txt|png|ya?ml)$")
# words that stand for a name the reader fills in (`benchmarks/NAME.py`)
PLACEHOLDERS = frozenset({"NAME", "DIR", "FILE", "OUT", "PATH"})
# the first folder of a path that names a file of this repository
REPO_DIRS = frozenset(
    p.name for p in (*ROOT.iterdir(), *PKG.iterdir()) if p.is_dir() and p.name[0] not in "._"
)
# paths in other projects' repositories that the docs cite, with whose they are
ELSEWHERE = {
    "docs/legacy.md": "DeepEP's repository (docs/calibration.md)",
}
# names the docs use for an instance of a class: its attributes are checked on the class
INSTANCES = {
    "config": ("dualpath.config.root", "Config"),
    "ledger": ("dualpath.ledger.ledger", "Ledger"),
    "policy": ("dualpath.policy.core", "PolicyCore"),
}


@cache
def module_file(module: str) -> Path | None:
    path = SRC.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


@cache
def top_names(path: Path) -> dict[str, ast.stmt]:
    return defined(tuple(ast.parse(path.read_text()).body))


def defined(body: tuple[ast.stmt, ...]) -> dict[str, ast.stmt]:
    """Names a module or class body binds (conditional and ``try`` branches included)."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update((n.id, node) for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            branches = [*node.body, *node.orelse]
            if isinstance(node, ast.Try):
                branches += [s for h in node.handlers for s in h.body]
            names.update(defined(tuple(branches)))
    return names


def resolves(module: str, names: list[str]) -> bool:
    """``names`` (submodules, then a name and its attributes) exist under ``module``."""
    path = module_file(module)
    if path is None:
        return False
    if not names:
        return True
    if path.name == "__init__.py" and module_file(f"{module}.{names[0]}") is not None:
        return resolves(f"{module}.{names[0]}", names[1:])
    node = top_names(path).get(names[0])
    rest = names[1:]
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom):
        source = node.module or ""
        if node.level or not source.startswith("dualpath"):
            return True  # another project's name: not ours to check
        name = next(a.name for a in node.names if (a.asname or a.name) == names[0])
        if module_file(f"{source}.{name}") is not None:
            return resolves(f"{source}.{name}", rest)
        return resolves(source, [name, *rest])
    if isinstance(node, ast.ClassDef) and rest:
        # a base class may define it: only a class without bases is held to its own body
        return rest[0] in defined(tuple(node.body)) or bool(node.bases)
    return True


def is_config_key(names: list[str]) -> bool:
    section = getattr(Config(), names[0], None)
    return is_dataclass(section) and names[1] in {f.name for f in fields(section)}


def dotted_ok(word: str) -> bool:
    names = word.split(".")
    if names[0] == "dualpath":
        return resolves("dualpath", names[1:])
    if resolves("dualpath", names):
        return True
    if names[0] in INSTANCES:
        module, cls = INSTANCES[names[0]]
        if resolves(module, [cls, *names[1:]]):
            return True
    return is_config_key(names)


def file_ok(path: str) -> bool:
    return path in ELSEWHERE or any((base / path).is_file() for base in (ROOT, PKG))


def stale(text: str) -> list[str]:
    """The paths and module names in ``text`` (Markdown) that name nothing here, one line each."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(1)
            parts = set(re.split(r"[/.]", path))
            if path.split("/")[0] in REPO_DIRS and not parts & PLACEHOLDERS and not file_ok(path):
                found.append(f"{n}: {path}")
        for span in TICK.findall(line):
            for word in re.split(r"[\s,()\[\]=:]+", span):
                word = word.strip("'\";").rstrip(".")
                first = word.split(".")[0]
                if not DOTTED.match(word) or FILE_NAME.search(word):
                    continue
                if (first == "dualpath" or module_file(f"dualpath.{first}")) and not dotted_ok(
                    word
                ):
                    found.append(f"{n}: {word}")
    return found


def test_every_path_and_module_in_the_docs_exists() -> None:
    found = [f"{doc.relative_to(ROOT)}:{hit}" for doc in DOCS for hit in stale(doc.read_text())]
    assert not found, "the docs name what is not here:\n" + "\n".join(found)


def test_the_check_finds_made_up_paths_and_modules() -> None:
    text = "\n".join(
        [
            "`src/dualpath/kv/pacer.py` and kv/buffer.py hold `kv.pacer.Pacer`, `ledger.Core`.",
            "`runtime/hops.py` and src/dualpath/serve/chat.py are gone, docs/nowhere.md too.",
            "`runtime.buffer.SlotBuffer`, `dualpath.kv.pacer.NoSuchPacer`, `ledger.no_such`.",
            "`workload.num_agents`, `config.sim.systems`, `policy.schedule` are real;",
            "`workload.no_such_key` is not, and `/tmp/x.py`, `runs/a.json` are not ours.",
        ]
    )
    assert stale(text) == [
        "2: runtime/hops.py",
        "2: src/dualpath/serve/chat.py",
        "2: docs/nowhere.md",
        "3: runtime.buffer.SlotBuffer",
        "3: dualpath.kv.pacer.NoSuchPacer",
        "3: ledger.no_such",
        "5: workload.no_such_key",
    ]
