"""Attention balance within the prefill EP group, measured as the paper does (Fig. 14):
max/avg of the per-GPU attention time of each forward pass, over the first half of the task
(offline batch, all agents at t = 0), DualPath vs round robin (``dpl``: same layerwise
prefill and both read paths, round-robin engine and read-side choice, no compute quota).

Also reported, to explain the figure: the share of passes in which some GPU of the group
had no attention work at all, the mean number of GPUs with work, and the mean attention
time of the busiest GPU against the compute quota.

    nice -n 5 .venv/bin/python benchmarks/attention_balance.py --agents 512,1024 --mal 64k \\
        [--preset ds660b-2p4d] [--systems dualpath,dpl] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import math
import time

from dualpath.config import apply_overrides, preset
from dualpath.metrics.balance import max_over_avg
from dualpath.sim.observe import Observer
from dualpath.sim.runner import build_cluster, run_cluster


def _measure(name: str, agents: int, mal: str, system: str, extra: list[str]) -> dict[str, float]:
    config = apply_overrides(
        preset(name), [f"workload.num_agents={agents}", f"workload.mal={mal}", *extra]
    )
    t0 = time.perf_counter()
    cluster = build_cluster(config, system)
    observer = Observer(cluster)
    run_cluster(cluster)
    jct = max(r.finish_s for r in cluster.records)
    half = [per_gpu for t, per_gpu in observer.attention if t < jct / 2]
    ratios = sorted(max_over_avg(p) for p in half)
    n = max(1, len(ratios))
    quota = config.scheduler.compute_quota_s
    # passes in which the quota bound: the busiest GPU was filled to ≥ 90% of it
    bound = [max_over_avg(p) for p in half if quota and max(p) >= 0.9 * quota]
    return {
        "jct_s": jct,
        "passes": len(half),
        "mean": math.fsum(ratios) / n,
        "p50": ratios[len(ratios) // 2] if ratios else math.nan,
        "p90": ratios[min(len(ratios) - 1, (9 * len(ratios)) // 10)] if ratios else math.nan,
        "idle_gpu_share": sum(1 for p in half if min(p) == 0.0) / n,
        "gpus_with_work": math.fsum(sum(1 for x in p if x > 0) for p in half) / n,
        "max_attention_ms": 1e3 * math.fsum(max(p) for p in half) / n,
        "quota_ms": 1e3 * (quota or 0.0),
        "bound_share": len(bound) / n,
        "bound_mean": math.fsum(bound) / len(bound) if bound else math.nan,
        # the best a planner could do without moving work between GPUs: every GPU with
        # work runs the same time, the idle ones none (16 / GPUs with work)
        "floor": math.fsum(len(p) / max(1, sum(1 for x in p if x > 0)) for p in half) / n,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ds660b-2p4d")
    ap.add_argument("--agents", default="512,1024")
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--systems", default="dualpath,dpl")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    print(f"{args.preset}, MAL {args.mal}, first half of the task {' '.join(args.set)}")
    for agents in [int(a) for a in args.agents.split(",")]:
        for system in [s.strip() for s in args.systems.split(",") if s.strip()]:
            r = _measure(args.preset, agents, args.mal, system, args.set)
            print(
                f"{agents:>5} agents {system:<9} JCT {r['jct_s']:7.1f} s  passes {r['passes']:>6}  "
                f"attention max/avg mean {r['mean']:.2f} p50 {r['p50']:.2f} p90 {r['p90']:.2f}  "
                f"passes with an idle GPU {r['idle_gpu_share']:.0%}  GPUs with work "
                f"{r['gpus_with_work']:.1f}  busiest GPU {r['max_attention_ms']:.1f} ms "
                f"(quota {r['quota_ms']:.0f} ms)  quota-bound passes {r['bound_share']:.0%} "
                f"max/avg there {r['bound_mean']:.2f}  no-move floor {r['floor']:.2f}  "
                f"wall {r['wall_s']:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
