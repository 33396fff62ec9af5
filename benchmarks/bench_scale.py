"""Weak scaling from the 2P4D unit to 48P96D (design §12: "near-linear from 2P4D to 48P96D
(1,152 GPUs); scheduler uses < 10 CPU cores"), and the simulator's speed at each size.

A cluster of k units is 2k prefill and 4k decode nodes of DS 660B, EP16 prefill groups over 2
nodes and EP32 decode groups over 4 (``cluster.prefill_ep_nodes=2, decode_ep_nodes=4``),
running k copies of one unit's workload (the same trajectories, new agent ids) under one
scheduler. Near-linear scaling means the k-unit job takes as long as the 1-unit job
(``JCT_k / JCT_1`` ≈ 1). Printed per run: the scheduler's host time (views + ``schedule``)
per simulated second (CPU cores it would need to keep up in real time), wall time,
events/s, the process's CPU time with events and turns per CPU second (steadier than wall
time on a shared machine; larger clusters coalesce more work into one event, so turns per
CPU second compares sizes more fairly than events) and the peak RSS of the process that
ran it (each run is its own process), CPU µs per event beside a bare ``heapq`` loop of as
many events timed in the same process (the machine's load reference), and with ``--before``
the ratio of CPU seconds per turn for each size.

``--before SRC`` also runs every size on another source tree (e.g. ``git archive main`` under
/tmp) in the same invocation, for a before/after comparison on the same machine and load;
``--repeat N`` alternates the trees N times and keeps each one's fastest run (a shared
machine's load only ever slows a run down).
``--sim-s S`` stops every run at simulated S seconds (a window of a long run: no JCT, turns
done so far; the event digests of two trees still compare).

    .venv/bin/python benchmarks/bench_scale.py [--units 1,24] [--agents 128] [--mal 32k]
        [--before /tmp/before/src] [--repeat 3] [--max-wall-s 3000] [--progress] [--sim-s S]

Paper scale offline (48P96D, 49,152 agents, MAL 32K; progress lines on stderr):

    nice -n 5 .venv/bin/python benchmarks/bench_scale.py --units 24 --agents 2048 --progress
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reference import bare_heapq_s  # benchmarks/reference.py (the script's folder)

SRC = Path(__file__).resolve().parents[1] / "src"


def build_units(k: int, agents: int, mal: str, system: str, sim_s: float = 0.0) -> tuple[Any, int]:
    """The k-unit cluster (built, not run; ``sim_s``: stop at that simulated time) and its
    number of agents."""
    from dualpath.config import apply_overrides, preset
    from dualpath.config.sim import SimConfig
    from dualpath.sim.runner import build_cluster
    from dualpath.workload import synthesize

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
    sim = SimConfig(max_sim_s=sim_s)
    return build_cluster(config, system, sim, trajectories=trajs), len(trajs)


def run_units(
    k: int, agents: int, mal: str, system: str, progress: bool = False, sim_s: float = 0.0
) -> dict[str, float]:
    from dualpath.sim.results import collect
    from dualpath.sim.runner import run_cluster

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    cluster, num_agents = build_units(k, agents, mal, system, sim_s)

    def report(sim_s: float, done: int, total: int) -> None:
        wall = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
        print(
            f"[{k} units] wall {wall:8.1f} s  CPU {time.process_time() - cpu0:8.1f} s  "
            f"sim {sim_s:8.1f} s  turns {done:,}/{total:,}  "
            f"events {cluster.loop.num_processed:,}  peak RSS {rss:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )

    run_cluster(cluster, report if progress else None)
    if cluster.num_turns_done < cluster.num_turns_total:  # stopped at --sim-s: no JCT
        num_turns, jct_s = cluster.num_turns_done, float("nan")
    else:
        result = collect(cluster)
        num_turns, jct_s = result.num_turns, result.jct_s
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    tokens = sum(r.prompt_tokens - r.hit_tokens + r.output_tokens for r in cluster.records)
    scheduler_s = getattr(cluster, "scheduler_s", float("nan"))  # nan: a tree without it
    return {
        "units": k,
        "gpus": 48 * k,
        "agents": num_agents,
        "turns": num_turns,
        "jct_s": jct_s,
        "tokens_per_s": tokens / jct_s,
        "scheduler_s": scheduler_s,
        "scheduler_cores": scheduler_s / jct_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "events": cluster.loop.num_processed,
        "events_per_s": cluster.loop.num_processed / wall,
        "events_per_cpu_s": cluster.loop.num_processed / cpu,
        "turns_per_cpu_s": num_turns / cpu,
        "flows_per_settle": cluster.net.num_settled_flows / max(cluster.net.num_settles, 1),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "digest": cluster.loop.log_digest(),
        "heapq_cpu_s": bare_heapq_s(cluster.loop.num_processed),
    }


def run_child(src: Path, k: int, args: argparse.Namespace) -> dict[str, float] | None:
    """One size on the tree ``src``, in a fresh process (its own peak RSS); None on timeout."""
    cmd = [sys.executable, __file__, "--child", str(k), "--agents", str(args.agents)]
    cmd += ["--mal", args.mal, "--system", args.system, "--sim-s", str(args.sim_s)]
    cmd += ["--progress"] if args.progress else []
    env = {**os.environ, "PYTHONPATH": str(src)}
    try:
        out = subprocess.run(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=None if args.progress else subprocess.PIPE,  # progress: to our stderr
            text=True,
            check=True,
            timeout=args.max_wall_s,
        )
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as err:
        sys.exit(f"bench_scale: {src} units={k} failed:\n{err.stderr}")
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", default="1,24", help="comma-separated unit counts (24 = 48P96D)")
    ap.add_argument("--agents", type=int, default=128, help="agents per unit")
    ap.add_argument("--mal", default="32k")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument("--before", type=Path, default=None, help="src/ of the tree to compare with")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree and size (fastest kept)")
    ap.add_argument("--max-wall-s", type=float, default=3600.0, help="per run; then 'timeout'")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--progress", action="store_true", help="print each run's progress to stderr")
    ap.add_argument(
        "--sim-s", type=float, default=0.0, help="stop at this simulated time (no JCT then)"
    )
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(
            json.dumps(
                run_units(args.child, args.agents, args.mal, args.system, args.progress, args.sim_s)
            )
        )
        return
    trees = [("this", SRC)] + ([("before", args.before)] if args.before else [])
    upto = f", to simulated {args.sim_s:g} s" if args.sim_s else ""
    print(f"DS 660B, {args.agents} agents per 2P4D unit, MAL {args.mal}, {args.system}{upto}")
    print(
        f"{'tree':>6} {'units':>5} {'GPUs':>5} {'agents':>7} {'JCT s':>8} {'JCT/JCT1':>9} "
        f"{'sched cores':>12} {'wall s':>8} {'events/s':>9} {'CPU s':>8} {'ev/CPU s':>9} "
        f"{'turns/CPU s':>11} {'RSS GiB':>8} {'µs/ev':>6} {'heapq':>6}  digest"
    )
    rows = []
    for k in (int(u) for u in args.units.split(",")):
        best: dict[str, dict[str, float] | None] = {}
        for _ in range(args.repeat):
            for name, src in trees:
                row = run_child(src, k, args)
                kept = best.get(name)
                if row is not None and (kept is None or row["wall_s"] < kept["wall_s"]):
                    best[name] = row
                else:
                    best.setdefault(name, None)
        for name, _ in trees:
            row = best[name]
            if row is None:
                print(f"{name:>6} {k:>5} {48 * k:>5}  timeout after {args.max_wall_s:.0f} s")
                continue
            rows.append({"tree": name, **row})
            base = next((r for r in rows if r["tree"] == name), row)
            print(
                f"{name:>6} {k:>5} {row['gpus']:>5} {row['agents']:>7} {row['jct_s']:>8.1f} "
                f"{row['jct_s'] / base['jct_s']:>9.3f} {row['scheduler_cores']:>12.4f} "
                f"{row['wall_s']:>8.1f} {row['events_per_s']:>9,.0f} {row['cpu_s']:>8.1f} "
                f"{row['events_per_cpu_s']:>9,.0f} {row['turns_per_cpu_s']:>11,.0f} "
                f"{row['peak_rss_gib']:>8.2f} {1e6 * row['cpu_s'] / row['events']:>6.1f} "
                f"{_heapq_us(row):>6}  {str(row['digest'])[:12]}",
                flush=True,
            )
        this, before = best.get("this"), best.get("before")
        if this is not None and before is not None:
            ratio = (before["cpu_s"] / before["turns"]) / (this["cpu_s"] / this["turns"])
            same = "same" if this["digest"] == before["digest"] else "DIFFERENT"
            print(f"{'':>6} {k:>5}  CPU per turn: before / this = {ratio:.2f}x; {same} digest")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def _heapq_us(row: dict[str, float]) -> str:
    """The bare heapq loop's µs per event ('-' for a tree whose benchmark lacks it)."""
    ref = row.get("heapq_cpu_s")
    return "-" if ref is None else f"{1e6 * ref / row['events']:.2f}"


if __name__ == "__main__":
    main()
