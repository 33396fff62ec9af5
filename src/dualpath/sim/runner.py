"""Drives one simulation: workload → cluster → event loop → results (offline batch mode).

Arrivals are a seam: offline runs start every agent at t = 0; an online mode passes other
start times to ``Cluster.add_agent`` and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dualpath.config import Config
from dualpath.config.sim import SimConfig
from dualpath.config.systems import system_spec
from dualpath.sim.cluster import Cluster
from dualpath.sim.results import SimResult, collect
from dualpath.workload import Trajectory, synthesize, turn_requests

Progress = Callable[[float, int, int], None]  # (sim time s, turns done, turns total)
PROGRESS_EVERY_S = 5.0  # simulated seconds between progress callbacks


def offline_arrivals(num_agents: int) -> list[float]:
    """Offline batch (RL rollout, design §9): every agent starts at t = 0."""
    return [0.0] * num_agents


def build_cluster(
    config: Config,
    system: str,
    sim: SimConfig | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    arrivals_s: Sequence[float] | None = None,
) -> Cluster:
    """A cluster for ``system`` with every agent of the workload added (not yet run).
    ``sim`` defaults to ``config.sim``."""
    sim = config.sim if sim is None else sim
    cluster = Cluster(config, system_spec(system), sim)
    block = config.scheduler.block_tokens
    trajs = synthesize(config.workload, block) if trajectories is None else trajectories
    starts = offline_arrivals(len(trajs)) if arrivals_s is None else arrivals_s
    if len(starts) != len(trajs):
        raise ValueError(f"arrivals_s has {len(starts)} entries for {len(trajs)} agents")
    for traj, start in zip(trajs, starts, strict=True):
        cluster.add_agent(traj.agent_id, turn_requests(traj, block), start)
    return cluster


def run_cluster(cluster: Cluster, progress: Progress | None = None) -> None:
    """Run until every turn of every agent finished (or ``sim.max_sim_s``), then let the
    last persistence writes land. RuntimeError if work is stuck (nothing left to happen)."""
    loop = cluster.loop
    limit = cluster.sim.max_sim_s or float("inf")
    while cluster.num_turns_done < cluster.num_turns_total and loop.now < limit:
        if loop.num_pending == 0:
            raise RuntimeError(
                f"simulation stuck at t={loop.now:.3f}s: {cluster.num_turns_done} of "
                f"{cluster.num_turns_total} turns done and nothing left to happen "
                "(a request larger than a DE's HBM or a PE's KV budget?)"
            )
        loop.run(until_s=min(loop.now + PROGRESS_EVERY_S, limit))
        if progress is not None:
            progress(loop.now, cluster.num_turns_done, cluster.num_turns_total)
    if cluster.num_turns_done == cluster.num_turns_total:
        loop.run()


def simulate(
    config: Config,
    system: str,
    sim: SimConfig | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    progress: Progress | None = None,
) -> SimResult:
    """Offline batch run of ``system`` on ``config``'s cluster and workload (seeded)."""
    cluster = build_cluster(config, system, sim, trajectories)
    run_cluster(cluster, progress)
    if cluster.num_turns_done < cluster.num_turns_total:
        raise RuntimeError(
            f"stopped at sim.max_sim_s={cluster.sim.max_sim_s}: "
            f"{cluster.num_turns_done} of {cluster.num_turns_total} turns done"
        )
    return collect(cluster)
