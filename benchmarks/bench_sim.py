"""Simulator speed: DS 660B 2P4D, 2048 agents, 64K MAL, one system (default dualpath).

Target: <= 60 s wall and <= 2 GiB peak RSS on the 2-core dev machine. Prints wall
time, CPU time, events/s, turns/s, CPU µs per turn and peak RSS. ``--profile`` prints the
top functions (cProfile). ``--before SRC`` also runs on another source tree (e.g. ``git
archive main`` under /tmp) in the same invocation, each run in its own process (its own peak
RSS), alternating ``--repeat`` times and keeping each tree's fastest in CPU seconds; beside
them a bare ``heapq`` loop of as many events, timed in the same process (a reference for the
machine's load).

    .venv/bin/python benchmarks/bench_sim.py [--agents 2048] [--mal 64k] [--system dualpath]
        [--set workload.synth=per_turn] [--before /tmp/before/src --repeat 2]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reference import bare_heapq_s  # benchmarks/reference.py (the script's folder)

SRC = Path(__file__).resolve().parents[1] / "src"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dualpath.config import apply_overrides, preset
    from dualpath.config.sim import SimConfig
    from dualpath.sim.results import collect
    from dualpath.sim.runner import build_cluster, run_cluster

    config = apply_overrides(
        preset(args.preset),
        [f"workload.num_agents={args.agents}", f"workload.mal={args.mal}", *args.set],
    )
    t0 = time.perf_counter()
    cpu0 = time.process_time()
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
    cpu = time.process_time() - cpu0
    events = cluster.loop.num_processed
    row = {
        "name": config.name,
        "turns": result.num_turns,
        "jct_s": result.jct_s,
        "wall_s": wall,
        "build_s": t_build,
        "cpu_s": cpu,
        "events": events,
        "flows": result.counters["flows"],
        "flows_by_kind": dict(cluster.transfers.flows_by_kind),
        "settles": cluster.net.num_settles,
        "rerated": cluster.net.num_settled_flows,
        "digest": cluster.loop.log_digest(),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "heapq_cpu_s": bare_heapq_s(events),
    }
    if profiler:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    return row


def show(name: str, r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"[{name}] {r['name']} {args.system}: {args.agents} agents, MAL {args.mal}")
    print(f"  turns          {r['turns']:,}")
    print(f"  simulated JCT  {r['jct_s']:,.1f} s")
    print(f"  wall           {r['wall_s']:.1f} s (build {r['build_s']:.1f} s)   target <= 60 s")
    print(
        f"  CPU            {r['cpu_s']:.1f} s, {1e6 * r['cpu_s'] / r['turns']:,.0f} µs per turn,"
        f" {1e6 * r['cpu_s'] / r['events']:.1f} µs per event"
        f" (bare heapq loop: {1e6 * r['heapq_cpu_s'] / r['events']:.2f} µs per event)"
    )
    print(f"  events         {r['events']:,} ({r['events'] / r['wall_s']:,.0f} events/s)")
    print(f"  turns/s        {r['turns'] / r['wall_s']:,.0f}")
    print(f"  flows          {r['flows']:,}")
    for kind, n in r["flows_by_kind"].items():
        print(f"    {kind:<22} {n:,}")
    print(f"  network settles {r['settles']:,} (flows re-rated {r['rerated']:,})")
    print(f"  event digest   {r['digest']}")
    print(f"  peak RSS       {r['peak_rss_gib']:.2f} GiB   target <= 2 GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ds660b-2p4d")
    ap.add_argument("--agents", type=int, default=2048)
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--before", type=Path, default=None, help="src/ of the tree to compare with")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree (fastest kept)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or not args.before:
        row = run(args)
        if args.child:
            print(json.dumps(row))
        else:
            show("this", row, args)
        return
    if not (args.before / "dualpath").is_dir():
        sys.exit(f"bench_sim: --before {args.before}: no dualpath package there")
    cmd = [sys.executable, __file__, "--child", "--preset", args.preset]
    cmd += ["--agents", str(args.agents), "--mal", args.mal, "--system", args.system]
    for kv in args.set:
        cmd += ["--set", kv]
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeat):
        for name, src in (("this", SRC), ("before", args.before)):
            env = {**os.environ, "PYTHONPATH": str(src)}
            out = subprocess.run(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if name not in best or row["cpu_s"] < best[name]["cpu_s"]:
                best[name] = row
    for name in ("this", "before"):
        show(name, best[name], args)
    this, before = best["this"], best["before"]
    per_turn = (before["cpu_s"] / before["turns"]) / (this["cpu_s"] / this["turns"])
    same = "same" if this["digest"] == before["digest"] else "DIFFERENT"
    print(
        f"CPU per turn: before / this = {per_turn:.2f}x; {same} event digest;"
        f" peak RSS {this['peak_rss_gib']:.2f} vs {before['peak_rss_gib']:.2f} GiB"
    )


if __name__ == "__main__":
    main()
