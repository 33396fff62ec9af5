"""Weak scaling from the 2P4D unit to 48P96D (SPEC §12: "near-linear from 2P4D to 48P96D
(1,152 GPUs); scheduler uses < 10 CPU cores").

A cluster of k units is 2k prefill and 4k decode nodes of DS 660B, EP16 prefill groups over 2
nodes and EP32 decode groups over 4 (``cluster.prefill_ep_nodes=2, decode_ep_nodes=4``),
running k copies of one unit's workload (the same trajectories, new agent ids) under one
scheduler. Near-linear scaling means the k-unit job takes as long as the 1-unit job
(``JCT_k / JCT_1`` ≈ 1, i.e. k times the throughput). Also printed: the scheduler's time
(``policy.schedule``, in this Python process) per simulated second, which is how many CPU
cores it would need to keep up in real time, and the simulator's own speed.

    .venv/bin/python benchmarks/bench_scale.py [--units 1,4,24] [--agents 128] [--mal 32k]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster
from dualpath.workload import synthesize


def run_units(k: int, agents: int, mal: str, system: str) -> dict[str, float]:
    config = apply_overrides(
        preset("ds660b-2p4d"),
        [
            f"workload.num_agents={agents}",
            f"workload.mal={mal}",
            f"cluster.num_prefill_nodes={2 * k}",
            f"cluster.num_decode_nodes={4 * k}",
            "cluster.prefill_ep_nodes=2",
            "cluster.decode_ep_nodes=4",
        ],
    )
    unit = synthesize(config.workload, config.scheduler.block_tokens)
    trajs = [
        dataclasses.replace(t, agent_id=copy * agents + t.agent_id)
        for copy in range(k)
        for t in unit
    ]
    t0 = time.perf_counter()
    cluster = build_cluster(config, system, SimConfig(), trajectories=trajs)
    schedule = cluster.policy.schedule
    spent = [0.0]

    def timed(view, now):  # type: ignore[no-untyped-def]
        s = time.perf_counter()
        out = schedule(view, now)
        spent[0] += time.perf_counter() - s
        return out

    cluster.policy.schedule = timed  # type: ignore[method-assign]
    run_cluster(cluster)
    result = collect(cluster)
    wall = time.perf_counter() - t0
    tokens = sum(r.prompt_tokens - r.hit_tokens + r.output_tokens for r in cluster.records)
    return {
        "units": k,
        "gpus": 48 * k,
        "agents": len(trajs),
        "turns": result.num_turns,
        "jct_s": result.jct_s,
        "tokens_per_s": tokens / result.jct_s,
        "scheduler_s": spent[0],
        "scheduler_cores": spent[0] / result.jct_s,
        "wall_s": wall,
        "events_per_s": cluster.loop.num_processed / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", default="1,4,24", help="comma-separated unit counts (24 = 48P96D)")
    ap.add_argument("--agents", type=int, default=128, help="agents per unit")
    ap.add_argument("--mal", default="32k")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    units = [int(u) for u in args.units.split(",")]
    rows = []
    print(f"DS 660B, {args.agents} agents per 2P4D unit, MAL {args.mal}, {args.system}")
    print(
        f"{'units':>5} {'GPUs':>5} {'agents':>7} {'JCT s':>8} {'JCT/JCT1':>9} "
        f"{'tok/s per unit':>15} {'sched cores':>12} {'wall s':>7} {'events/s':>9}"
    )
    for k in units:
        row = run_units(k, args.agents, args.mal, args.system)
        rows.append(row)
        base = rows[0]
        print(
            f"{k:>5} {row['gpus']:>5} {row['agents']:>7} {row['jct_s']:>8.1f} "
            f"{row['jct_s'] / base['jct_s']:>9.3f} {row['tokens_per_s'] / k:>15,.0f} "
            f"{row['scheduler_cores']:>12.4f} {row['wall_s']:>7.1f} {row['events_per_s']:>9,.0f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
