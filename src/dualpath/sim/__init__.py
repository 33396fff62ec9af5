"""Discrete-event cluster simulator: a shell around the policy core (docs/simulator.md).

Importing it first picks the core (``dualpath.sim.native``: compiled by mypyc when built and
current, else pure Python; ``DUALPATH_SIM_CORE`` chooses)."""

from dualpath.sim import native

native.install()  # before any other module of the package is imported

from dualpath.config.systems import SystemSpec, system_spec  # noqa: E402
from dualpath.sim.cluster import Cluster  # noqa: E402
from dualpath.sim.results import SimResult, collect  # noqa: E402
from dualpath.sim.runner import (  # noqa: E402
    build_cluster,
    offline_arrivals,
    run_cluster,
    simulate,
)

__all__ = [
    "Cluster",
    "SimResult",
    "SystemSpec",
    "build_cluster",
    "collect",
    "offline_arrivals",
    "run_cluster",
    "simulate",
    "system_spec",
]
