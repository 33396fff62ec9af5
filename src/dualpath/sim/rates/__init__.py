"""Rate recomputation of the fluid network (design §6): ``RateSolver`` (``solver.py``), the
network's one entry point, orchestrates parts that own their state and never call it: the
changes of the instant (``dirty.py``), the walk from them to the flows they can move
(``walk.py``), the HIGH refill (``high.py``), the incremental fill (``fill.py``, over
``maxmin.fill_max_min``) and the freezing order of capped flows (``capped.py``)."""

from dualpath.sim.rates.solver import RateSolver

__all__ = ["RateSolver"]
