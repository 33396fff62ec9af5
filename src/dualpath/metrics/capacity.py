"""Capacity search (design §9): the highest load (agents per second, APS) that meets the SLO.

Pure and deterministic: bisection over a caller-supplied ``passes(aps)`` predicate assumed
monotone (passes at a load ⇒ passes at every lower load). Runs nothing itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.config.checks import positive, require


@dataclass(frozen=True, slots=True)
class Probe:
    """One evaluation of the predicate: the load tried and whether it met the SLO."""

    aps: float
    passed: bool


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """Outcome of ``find_capacity``.

    capacity_aps: highest load seen to pass (0.0 if none passed);
    upper_aps: lowest load seen to fail (inf if none failed);
    converged: the bracket closed to ``upper_aps - capacity_aps ≤ rel_tol · capacity_aps``;
    probes: every evaluation, in the order made.
    """

    capacity_aps: float
    upper_aps: float
    converged: bool
    probes: tuple[Probe, ...]

    @property
    def num_probes(self) -> int:
        return len(self.probes)

    def to_dict(self) -> dict[str, object]:
        """JSON-safe (inf → None)."""
        return {
            "capacity_aps": self.capacity_aps,
            "upper_aps": None if math.isinf(self.upper_aps) else self.upper_aps,
            "converged": self.converged,
            "probes": [{"aps": p.aps, "passed": p.passed} for p in self.probes],
        }


def find_capacity(
    passes: Callable[[float], bool],
    lo_aps: float,
    hi_aps: float,
    rel_tol: float = 0.05,
    max_iter: int = 20,
) -> CapacityResult:
    """Highest APS for which ``passes`` holds, to relative tolerance ``rel_tol``.

    Probes ``lo_aps`` then ``hi_aps``. If ``lo_aps`` fails, halves it until a load passes;
    if ``hi_aps`` passes, doubles it until a load fails (the bracket grows). Then bisects
    (arithmetic midpoint) until ``hi - lo ≤ rel_tol · lo``. ``max_iter`` caps the number of
    probes in total (each probe is typically a whole simulation); when it runs out the result
    has ``converged=False`` and the best bracket found so far. No load is probed twice.
    """
    positive("lo_aps", lo_aps)
    require(hi_aps > lo_aps, "hi_aps", hi_aps, f"> lo_aps={lo_aps}")
    positive("rel_tol", rel_tol)
    require(max_iter >= 2, "max_iter", max_iter, ">= 2")
    probes: list[Probe] = []

    def probe(aps: float) -> bool:
        ok = bool(passes(aps))
        probes.append(Probe(aps, ok))
        return ok

    def result(lo: float, hi: float) -> CapacityResult:
        closed = lo > 0 and math.isfinite(hi) and hi - lo <= rel_tol * lo
        return CapacityResult(lo, hi, closed, tuple(probes))

    if probe(lo_aps):  # grow: find a failing upper end
        lo, hi = lo_aps, hi_aps
        while probe(hi):
            lo = hi
            if len(probes) >= max_iter:
                return result(lo, math.inf)
            hi *= 2
    else:  # shrink: find a passing lower end
        lo, hi = lo_aps / 2, lo_aps
        while not probe(lo):
            hi = lo
            if len(probes) >= max_iter:
                return result(0.0, hi)
            lo /= 2
    while hi - lo > rel_tol * lo and len(probes) < max_iter:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return result(lo, hi)
