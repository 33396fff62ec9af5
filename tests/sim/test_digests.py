"""The six reference runs of ``benchmarks/sim_digests.py`` give the event-log digests that
``benchmarks/sim_digests.txt`` holds: a refactor of the simulator (or of the policy, ledger
and cost model it runs) changes none of them. A change meant to change behaviour rewrites
the file (``sim_digests.py --write``) and says why."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_digests.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sim_digests", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DIGESTS = _script()


def test_the_file_holds_one_line_per_reference_run() -> None:
    lines = DIGESTS.expected_lines()
    assert [tuple(line.split()[:2]) for line in lines] == list(DIGESTS.RUNS)
    assert all(len(line.split()[-1]) == 64 for line in lines)  # SHA-256, hex


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DIGESTS.RUNS)), ids=lambda i: "-".join(DIGESTS.RUNS[i]))
def test_a_reference_run_gives_its_digest(index: int) -> None:
    name, system = DIGESTS.RUNS[index]
    assert DIGESTS.digest_line(name, system) == DIGESTS.expected_lines()[index]


def test_a_changed_run_changes_its_digest() -> None:
    """The digest sees a change of behaviour (one fewer agent), not only a crash."""
    name, system = DIGESTS.RUNS[-1]
    assert DIGESTS.digest_line(name, system, agents=63) != DIGESTS.expected_lines()[-1]
