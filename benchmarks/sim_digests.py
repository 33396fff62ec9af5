"""Event-log digests of six small reference runs: a refactor that must not change the
simulator's behaviour leaves every line of this output unchanged.

    .venv/bin/python benchmarks/sim_digests.py [--agents 64] [--set section.key=value]
    .venv/bin/python benchmarks/sim_digests.py --check   # against sim_digests.txt (exit 1)
    PYTHONPATH=/tmp/before/src python benchmarks/sim_digests.py   # the same on another tree

``sim_digests.txt`` beside this script holds the digests of the default runs (64 agents,
32K MAL, no ``--set``); ``tests/sim/test_digests.py`` asserts them. A change that is meant to
change the simulator's behaviour rewrites that file (``--write``) and says why in its commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
EXPECTED = Path(__file__).with_name("sim_digests.txt")


def digest_line(
    name: str, system: str, agents: int = 64, mal: str = "32k", sets: tuple[str, ...] = ()
) -> str:
    """One reference run: its preset, system, JCT and event-log digest, on one line."""
    config = apply_overrides(
        preset(name), [f"workload.num_agents={agents}", f"workload.mal={mal}", *sets]
    )
    cluster = build_cluster(config, system, SimConfig())
    run_cluster(cluster)
    result = collect(cluster)
    return f"{name:<12} {system:<9} JCT {result.jct_s:10.3f} s  {cluster.loop.log_digest()}"


def expected_lines() -> list[str]:
    """The digests of the default runs, as ``sim_digests.txt`` holds them."""
    return EXPECTED.read_text(encoding="utf-8").splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--mal", default="32k")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help=f"compare with {EXPECTED.name}")
    mode.add_argument("--write", action="store_true", help=f"rewrite {EXPECTED.name}")
    args = ap.parse_args()
    default = args.agents == 64 and args.mal == "32k" and not args.set
    if (args.check or args.write) and not default:
        ap.error("--check and --write take the default runs only (no --agents, --mal, --set)")
    lines = []
    for name, system in RUNS:
        lines.append(digest_line(name, system, args.agents, args.mal, tuple(args.set)))
        print(lines[-1], flush=True)
    if args.write:
        EXPECTED.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if args.check:
        expected = expected_lines()
        changed = [i for i, (a, b) in enumerate(zip(lines, expected, strict=True)) if a != b]
        for i in changed:
            print(f"changed: {RUNS[i][0]} {RUNS[i][1]} (was: {expected[i]})")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
