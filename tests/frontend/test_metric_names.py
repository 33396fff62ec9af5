"""One name per fact on ``/metrics``: every ``dualpath:*`` metric family is named in one module
of ``src/dualpath`` only, and the facts both servers report (our runtime's ``dualpath serve``
and the vLLM router) come from the same builders in ``frontend/metrics.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dualpath"
NAME = re.compile(r"dualpath:[a-z_]+")
SHARED = {  # what both servers report: built once, in frontend/metrics.py
    "dualpath:kv_bytes",
    "dualpath:prefix_cache_queries",
    "dualpath:prefix_cache_hits",
    "dualpath:prefix_cache_hit_ratio",
    "dualpath:num_aborted_requests",
    "dualpath:kv_persist_failed_blocks",
}


def metric_names(root: Path) -> dict[str, set[str]]:
    """Every string literal under ``root`` that is a whole ``dualpath:*`` metric name → the
    files (relative to ``root``) that spell it."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            is_str = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if is_str and NAME.fullmatch(node.value):
                out.setdefault(node.value, set()).add(str(path.relative_to(root)))
    return out


def spelled_twice(names: dict[str, set[str]]) -> list[str]:
    return sorted(f"{n}: {sorted(files)}" for n, files in names.items() if len(files) > 1)


def test_every_metric_family_is_named_in_one_module() -> None:
    names = metric_names(SRC)
    assert len(names) > 30  # the scan sees both servers' families
    assert spelled_twice(names) == []
    assert all(names[n] == {"frontend/metrics.py"} for n in SHARED), {n: names[n] for n in SHARED}


def test_both_servers_build_the_shared_facts_from_one_module() -> None:
    for server in ("integrations/vllm/collector.py", "frontend/metrics.py"):
        text = (SRC / server).read_text(encoding="utf-8")
        for builder in ("kv_bytes_family", "prefix_cache_families", "aborted_family"):
            assert f"{builder}(" in text, f"{server} does not report through {builder}"


def test_the_check_finds_a_name_spelled_twice(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('X = "dualpath:kv_bytes"\nY = "dualpath: a log line"\n')
    (tmp_path / "b.py").write_text('def f():\n    return "dualpath:kv_bytes"\n')
    assert spelled_twice(metric_names(tmp_path)) == ["dualpath:kv_bytes: ['a.py', 'b.py']"]
