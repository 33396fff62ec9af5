"""Event-log digests of six small reference runs: a refactor that must not change the
simulator's behaviour leaves every line of this output unchanged.

    .venv/bin/python benchmarks/sim_digests.py [--agents 64] [--set section.key=value]
    PYTHONPATH=/tmp/before/src python benchmarks/sim_digests.py   # the same on another tree
    DUALPATH_SIM_CORE=python .venv/bin/python benchmarks/sim_digests.py  # the pure core

The first line names the simulator core that ran (``dualpath.sim.native``); the compiled and
the pure core must print the same digests.
"""

from __future__ import annotations

import argparse

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster

RUNS = (
    ("ds660b-2p4d", "basic"),
    ("ds660b-2p4d", "layer"),
    ("ds660b-2p4d", "dpl"),
    ("ds660b-2p4d", "dualpath"),
    ("ds660b-2p4d", "oracle"),
    ("ds27b-1p1d", "dualpath"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--mal", default="32k")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    try:
        from dualpath.sim.native import core
    except ImportError:  # a tree from before the compiled core
        print("core: python")
    else:
        print(f"core: {core()}")
    for name, system in RUNS:
        config = apply_overrides(
            preset(name),
            [f"workload.num_agents={args.agents}", f"workload.mal={args.mal}", *args.set],
        )
        cluster = build_cluster(config, system, SimConfig())
        run_cluster(cluster)
        result = collect(cluster)
        print(f"{name:<12} {system:<9} JCT {result.jct_s:10.3f} s  {cluster.loop.log_digest()}")


if __name__ == "__main__":
    main()
