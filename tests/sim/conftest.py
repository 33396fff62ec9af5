"""Small, fast simulator setups shared by the sim tests."""

from __future__ import annotations

from dualpath.config import Config, apply_overrides, preset


def small_config(
    name: str = "ds27b-1p1d", agents: int = 8, mal: str = "32k", *overrides: str
) -> Config:
    """``name`` with ``agents`` agents of MAL ``mal`` (8 base trajectories, seed 0)."""
    return apply_overrides(
        preset(name),
        [
            f"workload.num_agents={agents}",
            f"workload.num_base_trajectories={min(agents, 8)}",
            f"workload.mal={mal}",
            *overrides,
        ],
    )
