"""The runtime's own CPU cost per turn: scheduler, storage workers, PEs, DEs.

Run: .venv/bin/python benchmarks/bench_cpu.py [--before SRC] [--systems basic,dualpath]

Runs the storage-bound agentic workload (``tiny-testbed``, emulated GPU time by default) once
per system and tree, each in a fresh interpreter, and prints the CPU seconds (user + system,
from ``/proc``) each role of process used during the run, per turn. With ``--before SRC``
another source tree (e.g. ``git archive <commit> | tar -x -C SRC``) runs the same workload
right after, so the two are measured under the same host load. The model's own compute is
in the PE / DE figures; what is avoidable is the rest (polling, pickling,
per-step Python), which does not shrink the JCT of a storage-bound run, only the host's
headroom.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, shutil, sys, tempfile, time
from dataclasses import replace
from dualpath.config import preset
from dualpath.runtime.options import RuntimeOptions
try:  # an older tree (--before) calls it LocalRuntime
    from dualpath.runtime.session import Runtime
except ImportError:
    from dualpath.runtime.session import LocalRuntime as Runtime
try:  # the tree since the scheduler was split into components
    from dualpath.workload.scripts import agent_scripts, small_trajectories
except ImportError:  # an older tree (--before)
    from dualpath.runtime.workload import agent_scripts, small_trajectories

def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    cfg = preset("tiny-testbed")
    cfg = replace(cfg, hardware=replace(cfg.hardware, snic_bytes_per_s=a["snic"] * 1e6),
                  workload=replace(cfg.workload, num_agents=a["agents"]))
    trajs = small_trajectories(cfg.workload, cfg.scheduler.block_tokens, a["turns"], 0.25, 4)
    agents = agent_scripts(trajs, cfg.model.vocab_size, cfg.workload.seed)
    root = tempfile.mkdtemp(prefix="bench-cpu-")
    kw = {"system": a["system"], "kv_root": root}
    if a["gpu_time"]:
        kw["gpu_time"] = a["gpu_time"]
    try:
        with Runtime(cfg, RuntimeOptions(**kw)) as rt:
            procs = {n: p.pid for n, p in rt.launcher.procs.items()}
            before = {n: cpu_s(pid) for n, pid in procs.items()}
            t0, c0 = time.monotonic(), time.process_time()
            res = rt.run(agents)
            wall, sched = time.monotonic() - t0, time.process_time() - c0
            used = {n: cpu_s(pid) - before[n] for n, pid in procs.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    roles = {"scheduler": sched, "storage": 0.0, "pe": 0.0, "de": 0.0}
    for n, c in used.items():
        roles["storage" if n.startswith("storage") else n[:2]] += c
    compute = {"pe": 0.0, "de": 0.0}  # the model's own passes (host time), where reported
    for n, u in getattr(res, "gpu_use", {}).items():
        compute[n[:2]] += u.host_s
    print(json.dumps({"turns": len(res.records), "wall_s": wall, "roles": roles,
                      "compute": compute,
                      "jct_s": max(r.finish_s for r in res.records)
                      - min(r.arrival_s for r in res.records)}))
"""


def run_tree(src: Path, args: argparse.Namespace, system: str) -> dict[str, object]:
    """One system's run from tree ``src`` in a fresh interpreter: its figures."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CHILD)
    env = {**os.environ, "PYTHONPATH": str(src / "src"), "OMP_NUM_THREADS": "1"}
    spec = {
        "system": system,
        "agents": args.agents,
        "turns": args.turns,
        "snic": args.snic_mb_per_s,
        "gpu_time": args.gpu_time,
    }
    try:
        out = subprocess.run(
            [sys.executable, f.name, json.dumps(spec)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        ).stdout
    finally:
        os.unlink(f.name)
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another source tree, measured right after this one")
    ap.add_argument("--systems", default="dualpath")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--snic-mb-per-s", type=float, default=10.0)
    ap.add_argument("--gpu-time", default="emulated", help="emulated or host ('' = the default)")
    args = ap.parse_args()
    trees = [("this tree", REPO)] + ([("before", Path(args.before))] if args.before else [])
    print(
        f"{args.agents} agents x {args.turns} turns, tiny-testbed, SNIC {args.snic_mb_per_s:g} "
        f"MB/s, GPU time {args.gpu_time or 'default'}; CPU seconds per turn (user + system)"
    )
    print(
        "| system | tree | load (1 min) | JCT s | scheduler | storage workers | PEs (of which "
        "the model's passes) | DEs (the model's steps) | total | total cores busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        for tree, src in trees:
            load = os.getloadavg()[0]
            r = run_tree(src, args, system)
            roles: dict[str, float] = r["roles"]  # type: ignore[assignment]
            n = float(r["turns"])  # type: ignore[arg-type]
            total = sum(roles.values())
            comp: dict[str, float] = r.get("compute", {})  # type: ignore[assignment]
            cells = " | ".join(
                f"{roles[k] / n * 1e3:.1f} ms"
                + (f" ({comp[k] / n * 1e3:.1f} model, wall)" if comp.get(k) else "")
                for k in ("scheduler", "storage", "pe", "de")
            )
            print(
                f"| {system} | {tree} | {load:.2f} | {r['jct_s']:.1f} | {cells} | "
                f"{total / n * 1e3:.1f} ms | {total / float(r['wall_s']):.2f} |"
            )  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
