"""Rate recomputation of the fluid network (SPEC §6): ``RateSolver`` (``solver.py``), the
network's one entry point for which flows a start or an end can move and their new max-min
rates."""

from dualpath.sim.rates.solver import RateSolver

__all__ = ["RateSolver"]
