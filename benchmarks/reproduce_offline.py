"""Reproduce design §12's offline claims with the simulator and print the tables.

1. JCT of Basic, DualPath and the Oracle for DS 660B 2P4D and DS 27B 1P1D at 32K/48K/64K MAL
   with 512, 1024 and 2048 agents: DualPath's speed-up over Basic and its fraction of Oracle.
2. The DS 27B P/D sweep (1P1D, 1P2D, 2P1D) and its three equalities:
   Basic 1P1D ≈ Basic 1P2D; DualPath 1P1D ≈ Basic 2P1D; DualPath 2P1D ≈ DualPath 1P2D;
   over a grid of agents (``--pd-agents``) × MALs (``--pd-mal``), with the speed-up averaged
   over the whole grid (the paper's average is over its agents × MAL grid).

Nothing is tuned to the paper's ratios: presets and the cost model are used as they are.
Long (tens of minutes to hours on 2 cores): run it in the background,

    nohup .venv/bin/python benchmarks/reproduce_offline.py --workers 2 > reproduce.log 2>&1 &

Results stream to stdout as they finish and go to runs/reproduce_offline/results.json.
``--ray-address local`` (a new Ray instance here) or ``--ray-address HOST:PORT`` (a Ray
cluster with this package on every node) runs the simulations as Ray tasks instead of the
local process pool; the results are the same.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import as_completed
from pathlib import Path

from dualpath.cli.common import add_ray_arg
from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim.fanout import study_pool
from dualpath.sim.runner import simulate

SYSTEMS = ("basic", "dualpath", "oracle")
PD_SHAPES = ("1p1d", "1p2d", "2p1d")
TURNS_PER_AGENT = {"32k": 60, "48k": 106, "64k": 157}  # design §9, for job ordering only

Job = tuple[str, str, str, int, str]  # (preset, P/D or "", MAL, agents, system)


def _run(job: Job) -> tuple[Job, float, float]:
    name, pd, mal, agents, system = job
    overrides = [f"workload.mal={mal}", f"workload.num_agents={agents}"]
    if pd:
        p, d = pd.rstrip("d").split("p")
        overrides += [f"cluster.num_prefill_nodes={p}", f"cluster.num_decode_nodes={d}"]
    t0 = time.perf_counter()
    result = simulate(apply_overrides(preset(name), overrides), system, SimConfig())
    return job, result.jct_s, time.perf_counter() - t0


def _cost(job: Job) -> float:
    name, _, mal, agents, system = job
    scale = 4.0 if name.startswith("ds660b") else 1.0
    return scale * agents * TURNS_PER_AGENT[mal] * (0.3 if system == "oracle" else 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="ds660b-2p4d,ds27b-1p1d")
    ap.add_argument("--mal", default="32k,48k,64k")
    ap.add_argument("--agents", default="512,1024,2048")
    ap.add_argument("--pd-mal", default="64k", help="MALs of the P/D sweep (comma-separated)")
    ap.add_argument("--pd-agents", default="1024", help="agents of the P/D sweep")
    ap.add_argument("--skip-pd", action="store_true")
    ap.add_argument("--skip-grid", action="store_true", help="only the P/D sweep")
    ap.add_argument("--workers", type=int, default=2)
    add_ray_arg(ap)
    ap.add_argument("--out", default="runs/reproduce_offline")
    ap.add_argument(
        "--previous",
        action="append",
        default=[],
        help="results.json of an earlier run: its jobs are reused, not rerun (repeatable)",
    )
    args = ap.parse_args()
    mals = args.mal.split(",")
    agents = [int(a) for a in args.agents.split(",")]
    jobs: list[Job] = []
    if not args.skip_grid:
        jobs += [
            (name, "", mal, n, s)
            for name in args.presets.split(",")
            for mal in mals
            for n in agents
            for s in SYSTEMS
        ]
    if not args.skip_pd:
        for pd_mal in args.pd_mal.split(","):
            for pd_agents in args.pd_agents.split(","):
                jobs += [
                    ("ds27b-1p1d", pd, pd_mal, int(pd_agents), s)
                    for pd in PD_SHAPES
                    for s in ("basic", "dualpath")
                ]
    jobs = list(dict.fromkeys(jobs))
    jct: dict[Job, float] = {}
    for path in args.previous:
        for row in json.loads(Path(path).read_text()):
            name, pd, mal, n, system = row["job"]
            jct[(name, pd, mal, int(n), system)] = float(row["jct_s"])
    todo = [j for j in jobs if j not in jct]
    t0 = time.perf_counter()
    with study_pool(args.workers, args.ray_address) as pool:
        futures = [pool.submit(_run, j) for j in sorted(todo, key=_cost, reverse=True)]
        for fut in as_completed(futures):
            job, value, wall = fut.result()
            jct[job] = value
            print(
                f"[{time.perf_counter() - t0:7.0f} s] {job}: JCT {value:.1f} s (wall {wall:.0f} s)",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps([{"job": list(j), "jct_s": jct[j]} for j in sorted(jct)], indent=2) + "\n"
    )
    all_mals = sorted({j[2] for j in jct if not j[1]}, key=lambda m: int(m.rstrip("k")))
    all_agents = sorted({j[3] for j in jct if not j[1]})
    print_tables(jct, args.presets.split(","), all_mals, all_agents, args.pd_mal, args.pd_agents)


def print_tables(
    jct: dict[Job, float],
    presets: list[str],
    mals: list[str],
    agents: list[int],
    pd_mal: str,
    pd_agents: str,
) -> None:
    print("\nOffline JCT (s): DualPath vs Basic vs Oracle")
    print(
        f"{'setup':<13} {'MAL':>4} {'agents':>6} {'Basic':>9} {'DualPath':>9} {'Oracle':>9} "
        f"{'DP/Basic':>9} {'DP vs Oracle':>12}"
    )
    for name in presets:
        for mal in mals:
            for n in agents:
                b, d, o = (jct.get((name, "", mal, n, s)) for s in SYSTEMS)
                if b is None or d is None or o is None:
                    continue
                print(
                    f"{name:<13} {mal:>4} {n:>6} {b:>9.1f} {d:>9.1f} {o:>9.1f} "
                    f"{b / d:>8.2f}× {o / d:>11.0%}"
                )
    speedups: list[float] = []
    cells = [(m, a) for m in pd_mal.split(",") for a in pd_agents.split(",")]
    for one_mal, pd_agent in cells:
        rows = {
            (pd, s): jct.get(("ds27b-1p1d", pd, one_mal, int(pd_agent), s))
            for pd in PD_SHAPES
            for s in ("basic", "dualpath")
        }
        if any(v is None for v in rows.values()):
            continue
        print(f"\nDS 27B P/D sweep ({pd_agent} agents, MAL {one_mal}): JCT (s)")
        print(f"{'shape':<6} {'Basic':>9} {'DualPath':>9} {'speed-up':>9}")
        for pd in PD_SHAPES:
            b, d = rows[(pd, "basic")], rows[(pd, "dualpath")]
            assert b is not None and d is not None
            print(f"{pd:<6} {b:>9.1f} {d:>9.1f} {b / d:>8.2f}×")
            speedups.append(b / d)

        def ratio(
            a: tuple[str, str],
            b: tuple[str, str],
            rows: dict = rows,  # type: ignore[type-arg]
        ) -> str:
            x, y = rows[a], rows[b]
            assert x is not None and y is not None
            return f"{x:.1f} vs {y:.1f} (ratio {x / y:.3f})"

        print("equalities (design §12):")
        print("  Basic 1P1D    ≈ Basic 1P2D    :", ratio(("1p1d", "basic"), ("1p2d", "basic")))
        print("  DualPath 1P1D ≈ Basic 2P1D    :", ratio(("1p1d", "dualpath"), ("2p1d", "basic")))
        print(
            "  DualPath 2P1D ≈ DualPath 1P2D :", ratio(("2p1d", "dualpath"), ("1p2d", "dualpath"))
        )
    if speedups:
        print(
            f"\nP/D sweep over the grid ({len(speedups)} shape × agents × MAL cells): "
            f"DualPath / Basic average {sum(speedups) / len(speedups):.2f}×, "
            f"max {max(speedups):.2f}× (paper: average 1.64×, up to 2.46×)"
        )


if __name__ == "__main__":
    main()
