"""DualPath: dual-path KV-cache loading for agentic LLM inference (arXiv 2602.21548).

Layers (imports point down only): types/units → config → models/workload/metrics →
policy → sim | runtime → api → cli.

The public API (docs/api.md) is here, loaded on first use so that ``import dualpath`` stays
light: ``dualpath.Config.from_preset``, ``dualpath.simulate``, ``dualpath.sweep``,
``dualpath.plan`` (and ``Simulation``, ``Sweep``, ``ResultCache``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dualpath.api import ResultCache, Simulation, Sweep, plan, simulate, sweep
    from dualpath.config import Config

_API = ("simulate", "sweep", "plan", "Simulation", "Sweep", "ResultCache")
__all__ = [
    "Config",
    "ResultCache",
    "Simulation",
    "Sweep",
    "__version__",
    "plan",
    "simulate",
    "sweep",
]


def __getattr__(name: str) -> Any:
    if name == "Config":
        from dualpath.config import Config

        return Config
    if name in _API:
        import dualpath.api

        return getattr(dualpath.api, name)
    raise AttributeError(f"module 'dualpath' has no attribute {name!r}")
