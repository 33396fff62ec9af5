"""Simulator speed: DS 660B 2P4D, 2048 agents, 64K MAL, one system (default dualpath).

Target: <= 60 s wall and <= 2 GiB peak RSS on the 2-core dev machine. Prints wall
time, events/s, turns/s and peak RSS. ``--profile`` prints the top functions (cProfile).

    .venv/bin/python benchmarks/bench_sim.py [--agents 2048] [--mal 64k] [--system dualpath]
        [--set workload.synth=per_turn]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import time

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ds660b-2p4d")
    ap.add_argument("--agents", type=int, default=2048)
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    config = apply_overrides(
        preset(args.preset),
        [f"workload.num_agents={args.agents}", f"workload.mal={args.mal}", *args.set],
    )
    t0 = time.perf_counter()
    cluster = build_cluster(config, args.system, SimConfig())
    t_build = time.perf_counter() - t0
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    run_cluster(cluster)
    if profiler:
        profiler.disable()
    result = collect(cluster)
    wall = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
    events = cluster.loop.num_processed
    print(f"{config.name} {args.system}: {args.agents} agents, MAL {args.mal}")
    print(f"  turns          {result.num_turns:,}")
    print(f"  simulated JCT  {result.jct_s:,.1f} s")
    print(f"  wall           {wall:.1f} s (build {t_build:.1f} s)   target <= 60 s")
    print(f"  events         {events:,} ({events / wall:,.0f} events/s)")
    print(f"  turns/s        {result.num_turns / wall:,.0f}")
    print(f"  flows          {result.counters['flows']:,}")
    for kind, n in cluster.transfers.flows_by_kind.items():
        print(f"    {kind:<22} {n:,}")
    print(
        f"  network settles {cluster.net.num_settles:,} (flows re-rated {cluster.net.num_settled_flows:,})"
    )
    print(f"  event digest   {cluster.loop.log_digest()}")
    print(f"  peak RSS       {rss_gib:.2f} GiB   target <= 2 GiB")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
