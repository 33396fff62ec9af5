"""How DualPath's gain depends on storage bandwidth: DS 660B 2P4D, SNIC 100 → 800 Gb/s.

    python examples/bandwidth_sweep.py [--agents 256] [--mal 64k] [--out runs/bandwidth_sweep]

One ``dualpath.sweep`` over ``hardware.snic_bytes_per_s`` (Basic, DualPath, Oracle at each
bandwidth; every simulation cached, so a re-run is instant), a pandas table of JCT and
speed-ups, and bandwidth_sweep.png: JCT per system against the SNIC bandwidth, and the
speed-up over Basic. docs/api.md walks through it; tests/api run it on a small batch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import dualpath

if TYPE_CHECKING:
    import pandas as pd

GBPS = (100, 200, 400, 800)  # one storage NIC per node, in Gb/s (the paper's is 400)


def bandwidth_table(sweep: dualpath.Sweep) -> pd.DataFrame:
    """JCT per system (columns) per SNIC bandwidth (rows, Gb/s), the speed-up of DualPath
    over Basic and its fraction of the Oracle's JCT."""
    df = sweep.frame()
    df["snic_gbps"] = df["hardware.snic_bytes_per_s"] * 8 / 1e9
    table = df.pivot(index="snic_gbps", columns="system", values="jct_s")
    table["speedup"] = table["basic"] / table["dualpath"]
    table["of_oracle"] = table["oracle"] / table["dualpath"]
    return table


def plot(table: pd.DataFrame, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    from dualpath.metrics.plots import colour

    fig = Figure(figsize=(9.5, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for system, label in (("basic", "Basic"), ("dualpath", "DualPath"), ("oracle", "Oracle")):
        left.plot(table.index, table[system], marker="o", label=label, color=colour(label, []))
    left.set_xscale("log", base=2)
    left.set_xticks(list(table.index), [f"{g:g}" for g in table.index])
    left.set_xlabel("SNIC bandwidth per node (Gb/s)")
    left.set_ylabel("offline JCT (s)")
    left.set_ylim(bottom=0)
    left.legend()
    left.grid(alpha=0.3)
    right.plot(table.index, table["speedup"], marker="o", color=colour("DualPath", []))
    right.axhline(1.0, ls=":", color="black", lw=0.8)
    right.set_xscale("log", base=2)
    right.set_xticks(list(table.index), [f"{g:g}" for g in table.index])
    right.set_xlabel("SNIC bandwidth per node (Gb/s)")
    right.set_ylabel("DualPath speed-up over Basic (×)")
    right.set_ylim(bottom=0.9)
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, facecolor="white")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=256, help="agents started together (256)")
    ap.add_argument("--mal", default="64k", help="maximum agent context length (64k)")
    ap.add_argument("--workers", type=int, default=2, help="parallel simulations (2)")
    ap.add_argument("--cache", default=None, help="result cache folder (default: runs/cache)")
    ap.add_argument("--out", default="runs/bandwidth_sweep", help="output folder")
    args = ap.parse_args(argv)

    config = dualpath.Config.from_preset(
        "ds660b-2p4d", [f"workload.num_agents={args.agents}", f"workload.mal={args.mal}"]
    )
    sweep = dualpath.sweep(
        config,
        {"hardware.snic_bytes_per_s": [g * 1e9 / 8 for g in GBPS]},
        systems="basic,dualpath,oracle",
        workers=args.workers,
        cache=args.cache if args.cache is not None else True,
        progress=True,
    )
    table = bandwidth_table(sweep)
    out = Path(args.out)
    sweep.write(out, f"SNIC bandwidth sweep: {config.name}, {args.agents} agents, MAL {args.mal}")
    title = (
        f"DS 660B 2P4D, {args.agents} agents, MAL {args.mal}: JCT and DualPath's speed-up "
        "against storage bandwidth"
    )
    plot(table, out / "bandwidth_sweep.png", title)
    print(table.to_string(float_format=lambda v: f"{v:.2f}"))
    print(f"{sweep.simulated} simulated, {sweep.from_cache} from the cache; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
