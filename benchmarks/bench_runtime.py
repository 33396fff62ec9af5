"""The real runtime, storage-bound 1P1D: DualPath / Basic JCT and achieved SNIC throughput.

Run: .venv/bin/python benchmarks/bench_runtime.py [--agents 16 --turns 12 --snic-mb-per-s 30]
Both systems replay the same small agentic workload (SPEC §9, scaled down) on the tiny model,
each on a fresh KV store, with the emulated SNICs slow enough that loading dominates. The
ideal JCT ratio for 1P1D is (P+D)/P = 2. SNIC utilisation "during loading" = bytes read /
(all SNICs' capacity × time during which any read was in progress).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from dualpath.cli.runtime_cmd import format_runs, run_runtime_systems
from dualpath.config import preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--snic-mb-per-s", type=float, default=30.0, help="emulated SNIC, MB/s")
    ap.add_argument("--token-scale", type=float, default=0.25)
    ap.add_argument("--max-gen", type=int, default=4)
    ap.add_argument("--systems", default="basic,dualpath")
    ap.add_argument("--kv-root", default="./.dualpath/bench-kv")
    ap.add_argument("--transport", default="shm", help="shm or mooncake")
    args = ap.parse_args()
    cfg = preset("tiny-1p1d")
    cfg = replace(
        cfg,
        hardware=replace(cfg.hardware, snic_bytes_per_s=args.snic_mb_per_s * 1e6),
        workload=replace(cfg.workload, num_agents=args.agents),
    )
    systems = [s for s in args.systems.split(",") if s]
    runs = run_runtime_systems(
        cfg,
        systems,
        args.turns,
        args.token_scale,
        args.max_gen,
        args.kv_root,
        False,
        args.transport,
    )
    print(
        f"1P1D, {cfg.hardware.gpus_per_node} engines/node, SNIC {args.snic_mb_per_s:g} MB/s, "
        f"{args.agents} agents x {args.turns} turns, transport {args.transport}; ideal DualPath/Basic speedup (P+D)/P = 2"
    )
    print(format_runs(runs))


if __name__ == "__main__":
    main()
