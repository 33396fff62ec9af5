"""The fluid network alone on a recorded paper-scale flow pattern: record, then replay.

``--record FILE`` runs the 48P96D cluster of ``bench_scale.py`` (``--units``, ``--agents``,
``--mal``, ``--system``) to simulated ``--from`` seconds, snapshots every live flow (path,
bytes left, class, rate cap), then records every flow start (time, path, size, class, rate
cap) until ``--to`` seconds into a gzipped JSON file, with the network's resources and
settings. It wraps the network's ``start_flow`` of that one run to do so (a benchmark tool,
not an observation hook of the simulator). Takes minutes (the cluster must reach ``--from``).

``--replay FILE`` starts the snapshot's flows at ``--from`` on a bare ``FluidNetwork`` +
``EventLoop`` and the recorded starts at their recorded times (open loop: a completion starts
nothing), runs to ``--from`` + ``--seconds`` (default: the whole window), and prints the CPU
seconds of the run, settles, flows re-rated, fallbacks, completions and a digest of every
completion (time, flow) and of the bytes left in every live flow at the end: two trees that
rate flows bit-identically print the same digest (and settles that kept a prefix, the exact
incremental rule of ``sim/rates/``; -1 on a tree without it). ``--before SRC`` replays on another tree too
(``git archive`` under /tmp), alternating ``--repeat`` times, keeping each tree's fastest.

    nice -n 5 .venv/bin/python benchmarks/bench_replay.py --record /tmp/w48.json.gz \\
        --units 24 --agents 2048 --from 125 --to 135
    .venv/bin/python benchmarks/bench_replay.py --replay /tmp/w48.json.gz --seconds 2 \\
        --before /tmp/before/src --repeat 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"


def record(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_scale import build_units
    from dualpath.sim.flowreplay import record_window

    cluster, _ = build_units(args.units, args.agents, args.mal, args.system)
    cpu0 = time.process_time()
    data = {"units": args.units, "agents": args.agents}
    data.update(record_window(cluster, args.t_from, args.t_to))
    cpu = time.process_time() - cpu0
    with gzip.open(args.record, "wt") as f:
        json.dump(data, f)
    print(
        f"recorded {len(data['initial']):,} live flows at {args.t_from} s and"
        f" {len(data['starts']):,} starts to {args.t_to} s into {args.record}"
        f" (CPU {cpu:.1f} s)"
    )


def replay(path: Path, seconds: float | None) -> dict[str, Any]:
    """Replay on the tree that ``dualpath`` imports from (``sim/flowreplay.replay_window``);
    returns the figures."""
    try:
        from dualpath.sim.flowreplay import replay_window
    except ImportError:
        print(
            "bench_replay: this tree has no dualpath.sim.flowreplay.replay_window: "
            "compare with a tree that has it",
            file=sys.stderr,
        )
        sys.exit(2)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return replay_window(data, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", type=Path, help="record a window of a paper-scale run here")
    ap.add_argument("--units", type=int, default=24)
    ap.add_argument("--agents", type=int, default=2048, help="agents per unit")
    ap.add_argument("--mal", default="32k")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument("--from", dest="t_from", type=float, default=125.0, help="window start, s")
    ap.add_argument("--to", dest="t_to", type=float, default=135.0, help="window end, s")
    ap.add_argument("--replay", type=Path, help="replay a recorded window")
    ap.add_argument("--seconds", type=float, default=None, help="replay this much of it")
    ap.add_argument("--before", type=Path, default=None, help="src/ of the tree to compare with")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree (fastest kept)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        record(args)
        return
    if not args.replay:
        ap.error("give --record FILE or --replay FILE")
    if not args.replay.is_file():
        print(f"bench_replay: --replay {args.replay}: no such file", file=sys.stderr)
        sys.exit(2)
    if args.child:
        print(json.dumps(replay(args.replay, args.seconds)))
        return
    trees = [("this", SRC)] + ([("before", args.before)] if args.before else [])
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeat):
        for name, src in trees:
            cmd = [sys.executable, __file__, "--child", "--replay", str(args.replay)]
            cmd += [] if args.seconds is None else ["--seconds", str(args.seconds)]
            out = subprocess.run(
                cmd,
                env={**os.environ, "PYTHONPATH": str(src)},
                stdout=subprocess.PIPE,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if name not in best or row["cpu_s"] < best[name]["cpu_s"]:
                best[name] = row
    print(
        f"{'tree':>6} {'window s':>15} {'flows':>8} {'CPU s':>7} {'settles':>8} "
        f"{'re-rated':>10} {'µs/re-rated':>11} {'fallbacks':>9} {'retries':>7} {'incr.':>7}"
        f" {'done':>7}  digest"
    )
    for name, _ in trees:
        r = best[name]
        print(
            f"{name:>6} {r['window_s'][0]:>7.1f}-{r['window_s'][1]:<7.1f} {r['flows']:>8,}"
            f" {r['cpu_s']:>7.2f} {r['settles']:>8,} {r['rerated']:>10,}"
            f" {1e6 * r['cpu_s'] / max(r['rerated'], 1):>11.2f} {r['fallbacks']:>9,}"
            f" {r.get('retries', -1):>7,} {r.get('incremental', -1):>7,}"
            f" {r['completions']:>7,}  {r['digest']}"
        )


if __name__ == "__main__":
    main()
