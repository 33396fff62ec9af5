"""The public Python API of the simulator (docs/api.md): ``simulate``, ``sweep``, ``plan`` and
their result objects, which turn into pandas DataFrames and the CLI's JSON/CSV/PNG files.

Imports the simulator and the planner; imported by nothing but ``dualpath`` (lazily) and the
CLI."""

from __future__ import annotations

from dualpath.api.frames import flatten, metric_row, turn_row
from dualpath.api.grid import Axis, Choice, Sweep, SweepPoint, sweep
from dualpath.api.simulation import Simulation, as_config, setting_title, simulate
from dualpath.config import Config
from dualpath.models.planner import PlanReport
from dualpath.models.planner import plan as _plan
from dualpath.sim.cache import ResultCache, code_version


def plan(config: Config | str, p: int | None = None, d: int | None = None) -> PlanReport:
    """design §5's bottleneck-free P/D range and the per-resource loads at P, D (default: the
    config's cluster) for a ``Config`` or a preset name. No simulation."""
    return _plan(as_config(config), p, d)


__all__ = [
    "Axis",
    "Choice",
    "Config",
    "PlanReport",
    "ResultCache",
    "Simulation",
    "Sweep",
    "SweepPoint",
    "code_version",
    "flatten",
    "metric_row",
    "plan",
    "setting_title",
    "simulate",
    "sweep",
    "turn_row",
]
