"""Discrete-event cluster simulator: a shell around the policy core (docs/simulator.md)."""

from dualpath.config.systems import SystemSpec, system_spec
from dualpath.sim.cluster import Cluster
from dualpath.sim.results import SimResult, collect
from dualpath.sim.runner import (
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
