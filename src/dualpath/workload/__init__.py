"""Workloads: synthetic agentic trajectories (design §9), their per-turn requests, Mooncake traces."""

from dualpath.workload.mooncake import TraceRequest, load_mooncake
from dualpath.workload.stats import WorkloadStats, trajectory_stats
from dualpath.workload.synth import SPEC_TABLE, mal_tokens, synthesize
from dualpath.workload.trajectory import (
    Trajectory,
    TrajectoryTurn,
    TurnSpec,
    persisted_tokens,
    turn_requests,
)

__all__ = [
    "SPEC_TABLE",
    "TraceRequest",
    "Trajectory",
    "TrajectoryTurn",
    "TurnSpec",
    "WorkloadStats",
    "load_mooncake",
    "mal_tokens",
    "persisted_tokens",
    "synthesize",
    "trajectory_stats",
    "turn_requests",
]
