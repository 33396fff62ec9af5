"""One vocabulary: every latency metric is defined in ``metrics.latency`` and every
KV path named by ``types.KVPath``; the simulator's records, the runtime's, the server's
``/metrics`` and the load generator all use them, and nothing else defines them."""

from __future__ import annotations

import ast
import functools
import math
from pathlib import Path

import pytest

from dualpath.frontend.loadgen import RequestResult
from dualpath.metrics import TurnRecord, latency
from dualpath.types import KVPath

SRC = Path(__file__).resolve().parents[2] / "src" / "dualpath"
LATENCY = SRC / "metrics" / "latency.py"
# literal path names still written out in the simulator's cluster wiring (left for a later
# rewrite of that wiring); nowhere else may a KV path be spelled as a string
KV_LITERALS_LEFT = {SRC / "sim" / "cluster.py"}
OLD_PATH_NAMES = {
    "pe_read",
    "de_read",
    "pd_transfer",
    "persist",
    "persisted",
    "layer_blocks_to_pe",
    "pe_to_de_buffer",
    "de_buffer_to_hbm",
}


@functools.cache
def _trees() -> list[tuple[Path, ast.AST]]:
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(SRC.rglob("*.py"))]


def test_every_latency_metric_is_defined_once() -> None:
    """A function or property named after a metric outside ``metrics.latency`` only calls
    ``latency.<that metric>``; no division by ``(n - 1)`` / ``(n - 2)`` elsewhere."""
    names = set(latency.DEFINITIONS)
    assert names == {"ttft_s", "ttst_s", "tpot_s", "itl_s"}
    defs = 0
    for path, tree in _trees():
        if path == LATENCY:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                defs += 1
                calls = [
                    c
                    for c in ast.walk(node)
                    if isinstance(c, ast.Call)
                    and isinstance(c.func, ast.Attribute)
                    and c.func.attr == node.name
                    and isinstance(c.func.value, ast.Name)
                    and c.func.value.id == "latency"
                ]
                assert calls, f"{path}:{node.lineno} defines {node.name} itself"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                right = node.right
                assert not (
                    isinstance(right, ast.BinOp)
                    and isinstance(right.op, ast.Sub)
                    and isinstance(right.right, ast.Constant)
                    and right.right.value in (1, 2)
                ), f"{path}:{node.lineno}: {ast.unparse(node)} (a per-token latency?)"
    assert defs >= 7  # TurnRecord's four, the load generator's three


def test_every_kv_path_is_named_by_the_enum() -> None:
    values = {p.value for p in KVPath}
    for path, tree in _trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            assert node.value not in OLD_PATH_NAMES, f"{path}:{node.lineno}: {node.value!r}"
            if node.value in values and path.name != "types.py":
                assert path in KV_LITERALS_LEFT, f"{path}:{node.lineno}: use KVPath"


def test_shells_and_load_generator_agree_on_one_timeline() -> None:
    """One turn, arrival 1 s, first token 3 s, second 3.5 s, 6 tokens done at 5.5 s: the
    record (every shell's) and the load generator (same times from its start) give the same
    TTFT, TTST, TPOT and ITL, those of the definitions."""
    rec = TurnRecord(0, 0, 0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.5, 5.5, 100, 64, 6, "de")
    res = RequestResult(
        "agent-0",
        0,
        ok=True,
        start_s=1.0,
        ttft_s=2.0,
        second_token_s=2.5,
        end_s=5.5,
        completion_tokens=6,
    )
    assert rec.ttft_s == res.ttft_s == 2.0
    assert rec.ttst_s == res.ttst_s == 0.5
    assert rec.tpot_s == res.tpot_s == pytest.approx((5.5 - 3.5) / 4)
    assert rec.itl_s == res.itl_s == pytest.approx((5.5 - 3.0) / 5)


@pytest.mark.parametrize(("n", "ttst", "tpot", "itl"), [(1, None, None, None), (2, 0.5, None, 2.0)])
def test_short_outputs_leave_metrics_undefined(
    n: int, ttst: float | None, tpot: float | None, itl: float | None
) -> None:
    second = 1.0 if n == 1 else 1.5
    assert latency.ttst_s(1.0, second, n) == ttst
    assert latency.tpot_s(second, 3.0, n) == tpot
    got = latency.itl_s(1.0, 3.0, n)
    assert got == itl and (got is None or math.isfinite(got))


def test_run_result_and_server_stats_share_the_path_names() -> None:
    from dualpath.ledger.counters import RunCounters
    from dualpath.runtime.result import kv_bytes_by_path

    counters = RunCounters()
    counters.moved(KVPath.STORAGE_TO_PE_BUFFER, 1)
    counters.moved(KVPath.DE_TO_STORAGE, 60)
    paths = kv_bytes_by_path(counters)
    assert set(paths) <= set(KVPath) and len(paths) == 6
    assert paths[KVPath.DE_TO_STORAGE] == 60 and paths["storage_to_pe_buffer"] == 1
    assert counters.read_bytes() == 1


def test_summaries_name_latencies_as_the_definitions_do() -> None:
    """The simulator's and runtime's ``RunSummary`` and the load generator's summary report
    each latency under its ``metrics.latency`` name, with the same values for one turn."""
    from dualpath.frontend.loadgen import LoadgenResult
    from dualpath.metrics import summarize

    rec = TurnRecord(0, 0, 0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.5, 5.5, 100, 64, 6, "de")
    res = RequestResult(
        "agent-0",
        0,
        ok=True,
        start_s=1.0,
        ttft_s=2.0,
        second_token_s=2.5,
        end_s=5.5,
        completion_tokens=6,
    )
    shells = summarize([rec]).to_dict()
    client = LoadgenResult([res], [4.5], wall_s=4.5).summary()
    common = {"ttft_s", "ttst_s", "tpot_s"}
    assert common <= set(shells) and {*common, "itl_s"} <= set(client)
    assert {k for k in {*shells, *client} if k.endswith(("ft_s", "st_s", "ot_s", "tl_s"))} <= {
        *latency.DEFINITIONS
    }
    for key in common:
        assert shells[key]["p50"] == pytest.approx(client[key]["p50"]), key  # type: ignore[index]
