"""Wall time of `dualpath figures --quick` and the speed-ups it shows (targets:
≤ 90 s on 2 cores, DualPath ≥ 1.4× over Basic offline, every ablation step visible).

    .venv/bin/python benchmarks/bench_figures.py [--out /tmp/figq] [--workers 2] [--cached]

Runs the command in a subprocess (its own cache folder, empty unless ``--cached``: then it
runs twice and times the second, served from the cache), then prints the wall time, the
offline / P/D speed-ups, the ablation steps and the online capacities from ``OUT/data``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(out: Path, cache: Path, workers: int) -> float:
    cmd = [sys.executable, "-m", "dualpath.cli.main", "figures", "--quick", "--out", str(out)]
    cmd += ["--workers", str(workers), "--cache-dir", str(cache), "--no-progress"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def speedups(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by.setdefault(tuple(r[k] for k in keys), {})[r["system"]] = r["jct_s"]
    return [
        f"{' '.join(map(str, k))}: DualPath {v['Basic'] / v['DualPath']:.2f}x over Basic"
        for k, v in by.items()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cached", action="store_true", help="time a second, cached run")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="figq-"))
    cache = out / "cache"
    wall = run(out, cache, args.workers)
    print(f"figures --quick: {wall:.1f} s wall (workers {args.workers}, empty cache)")
    if args.cached:
        print(f"again, from the cache: {run(out, cache, args.workers):.1f} s wall")
    data = out / "data"
    for line in speedups(
        json.loads((data / "offline_jct.json").read_text()), ("model", "mal", "agents")
    ):
        print("offline", line)
    for line in speedups(json.loads((data / "pd_sweep.json").read_text()), ("pd",)):
        print("P/D", line)
    steps = json.loads((data / "ablation.json").read_text())
    print("ablation: " + ", ".join(f"{r['system']} {r['speedup_vs_basic']:.2f}x" for r in steps))
    for r in json.loads((data / "capacity.json").read_text()):
        print(f"capacity {r['setting']} {r['system']}: {r['capacity_aps']:g} APS ({r['method']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
