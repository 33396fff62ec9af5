"""`dualpath sim` and `dualpath sweep`: run the cluster simulator and write its results.

Config: preset → TOML → ``--set`` (``sim.*`` keys go to ``SimConfig``); every mistake is a
``ValueError`` (main.py prints one line, exit 2). Output folder: config.json, results.json,
results.csv and a PNG plot (sweep: sweep.json, sweep.csv, sweep.png).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from concurrent.futures import as_completed
from pathlib import Path
from typing import Any

from dualpath.cli.common import add_config_args
from dualpath.config import Config, apply_overrides, config_for, load_toml, preset, to_dict
from dualpath.config.sim import SimConfig, parse_systems
from dualpath.config.systems import system_spec
from dualpath.sim.fanout import add_ray_arg, study_pool
from dualpath.sim.plots import plot_results, plot_sweep
from dualpath.sim.report import (
    CSV_COLUMNS,
    comparisons,
    csv_row,
    format_table,
    order_systems,
    results_json,
)
from dualpath.sim.results import SimResult
from dualpath.sim.runner import simulate
from dualpath.units import parse_tokens

DEFAULT_RUN = ("ds27b-1p1d", ("workload.num_agents=1024", "workload.mal=32k"))


# ---------------------------------------------------------------------- config plumbing
def build_inputs(args: argparse.Namespace) -> tuple[Config, SimConfig]:
    """Preset → TOML → --set (``sim.*`` included), then the convenience flags (--agents,
    --mal, --seed, --systems, --no-traffic-manager). The returned config carries the sim."""
    config = preset(args.preset)
    if getattr(args, "config", None):
        config = load_toml(args.config, base=config)
    flags = []
    if getattr(args, "agents", None) is not None:
        flags.append(f"workload.num_agents={args.agents}")
    if getattr(args, "mal", None):
        flags.append(f"workload.mal={args.mal.lower()}")
    if getattr(args, "seed", None) is not None:
        flags.append(f"workload.seed={args.seed}")
    config = apply_overrides(config, [*args.overrides, *flags])
    sim = config.sim
    if getattr(args, "systems", None):
        sim = dataclasses.replace(sim, systems=",".join(order_systems(parse_systems(args.systems))))
    if getattr(args, "no_traffic_manager", False):
        sim = dataclasses.replace(sim, traffic_manager=False)
    return dataclasses.replace(config, sim=sim), sim


def default_out_dir(config: Config, sim: SimConfig, overrides: Sequence[str]) -> Path:
    """runs/sim-<preset>-<MAL>-<agents>a-<systems>[-<hash of overrides>]: no timestamp."""
    name = (
        f"sim-{config.name}-{config.workload.mal.lower()}-{config.workload.num_agents}a-"
        + "+".join(sim.system_list)
    )
    if overrides:
        name += "-" + hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8]
    return Path("runs") / name


# ---------------------------------------------------------------------- running
def run_systems(config: Config, sim: SimConfig, progress: bool = True) -> dict[str, SimResult]:
    """Every system of ``sim.systems`` on the same config (workload, seed, cost model)."""
    from tqdm import tqdm

    for name in sim.system_list:  # a scheduler.policy no system may run: fail before any
        config_for(config, system_spec(name))
    results: dict[str, SimResult] = {}
    for name in order_systems(sim.system_list):
        bar = tqdm(desc=f"{name:<8}", unit="turn", disable=not progress, leave=True)

        def tick(now: float, done: int, total: int, bar: Any = bar) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"sim {now:,.0f} s")

        results[name] = simulate(config, name, sim, progress=tick)
        bar.close()
    return results


def write_outputs(
    out: Path, config: Config, sim: SimConfig, results: dict[str, SimResult], title: str
) -> list[Path]:
    """config.json, results.json, results.csv, jct.png under ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / n for n in ("config.json", "results.json", "results.csv", "jct.png")]
    resolved = {"config": to_dict(config), "sim": dataclasses.asdict(sim)}
    files[0].write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
    files[1].write_text(json.dumps(results_json(results), indent=2, sort_keys=True) + "\n")
    comp = comparisons(results)
    with files[2].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS))
        writer.writeheader()
        for name, r in results.items():
            writer.writerow(csv_row(r, comp[name]))
    plot_results(results, files[3], title)
    return files


def _title(config: Config) -> str:
    w = config.workload
    return f"{config.name} ({config.cluster.label}), {w.num_agents} agents, MAL {w.mal}"


def run_sim(args: argparse.Namespace) -> int:
    config, sim = build_inputs(args)
    out = Path(args.out or sim.out_dir or default_out_dir(config, sim, args.overrides))
    t0 = time.perf_counter()
    results = run_systems(config, sim, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    files = write_outputs(out, config, sim, results, _title(config))
    print(format_table(results, _title(config)))
    print(f"wall {wall:.1f} s; wrote " + ", ".join(str(f) for f in files))
    return 0


def run_default(out_dir: str) -> int:
    """`make run`'s main job: DS 27B 1P1D, 1024 agents, 32K MAL, Basic vs DualPath vs Oracle."""
    name, overrides = DEFAULT_RUN
    args = argparse.Namespace(
        preset=name,
        config=None,
        overrides=list(overrides),
        agents=None,
        mal=None,
        seed=None,
        systems="basic,dualpath,oracle",
        no_traffic_manager=False,
        out=out_dir,
        no_progress=False,
    )
    return run_sim(args)


def add_sim_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "sim", help="simulate the cluster offline: DualPath vs Basic vs Oracle (SPEC §11)"
    )
    add_config_args(p)
    p.add_argument("--agents", type=int, help="number of agents (workload.num_agents)")
    p.add_argument("--mal", help="maximum agent context length: 32k, 48k or 64k")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument(
        "--systems",
        help="comma-separated: basic, layer, dpl, dualpath, oracle "
        "(default: basic,dualpath,oracle)",
    )
    p.add_argument("--no-traffic-manager", action="store_true", help="one traffic class")
    p.add_argument("--out", help="output folder (default: runs/<derived name>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sim)


# ---------------------------------------------------------------------- sweep
def _pd_overrides(text: str) -> list[str]:
    low = text.strip().lower()
    try:
        p, d = low.rstrip("d").split("p")
        return [f"cluster.num_prefill_nodes={int(p)}", f"cluster.num_decode_nodes={int(d)}"]
    except ValueError:
        raise ValueError(f"--pd {text!r} is invalid: must look like 1p2d") from None


def _job(job: tuple[str, tuple[str, ...], str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    name, overrides, system, sim_fields = job
    config = apply_overrides(preset(name), overrides)
    result = simulate(config, system, SimConfig(**sim_fields))
    return system, result.to_dict()


def sweep_jobs(args: argparse.Namespace) -> list[tuple[str, tuple[str, str, tuple[str, ...]]]]:
    """(point label, (preset, system, overrides)) for the whole grid, in a fixed order."""
    presets = [p.strip() for p in (args.presets or args.preset).split(",") if p.strip()]
    mals = [m.strip().lower() for m in args.mal.split(",")]
    agents = [int(parse_tokens(a)) for a in str(args.agents).split(",")]
    pds = [x.strip() for x in args.pd.split(",")] if args.pd else [""]
    config_overrides = list(args.overrides)
    systems = order_systems(parse_systems(args.systems))
    out: list[tuple[str, tuple[str, str, tuple[str, ...]]]] = []
    for name in presets:
        preset(name)  # ValueError early
        for pd in pds:
            for mal in mals:
                for n in agents:
                    overrides = (
                        *config_overrides,
                        *(_pd_overrides(pd) if pd else []),
                        f"workload.mal={mal}",
                        f"workload.num_agents={n}",
                    )
                    apply_overrides(preset(name), overrides)  # validate before forking
                    label = f"{name}{'/' + pd if pd else ''}/{mal}/{n}"
                    out.extend((label, (name, s, overrides)) for s in systems)
    return out


def run_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    sim = apply_overrides(preset(args.preset), args.overrides).sim
    jobs = sweep_jobs(args)
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} is invalid: must be >= 1")
    sim_fields = dataclasses.asdict(sim)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with study_pool(args.workers, args.ray_address) as pool:
        futures = {
            pool.submit(_job, (name, overrides, system, sim_fields)): (label, system)
            for label, (name, system, overrides) in jobs
        }
        for fut in tqdm(as_completed(futures), total=len(futures), disable=args.no_progress):
            rows[futures[fut]] = fut.result()[1]
    points = list(dict.fromkeys(label for label, _ in jobs))
    systems = list(dict.fromkeys(s for _, (_, s, _) in jobs))
    out = Path(
        args.out
        or Path("runs")
        / ("sweep-" + hashlib.sha256(json.dumps([j for j in jobs]).encode()).hexdigest()[:10])
    )
    out.mkdir(parents=True, exist_ok=True)
    table = []
    for p in points:
        base = rows.get((p, "basic"))
        orc = rows.get((p, "oracle"))
        for s in systems:
            r = rows[(p, s)]
            table.append(
                {
                    "point": p,
                    "system": s,
                    "jct_s": r["jct_s"],
                    "speedup_vs_basic": base["jct_s"] / r["jct_s"] if base else None,
                    "fraction_of_oracle": orc["jct_s"] / r["jct_s"] if orc else None,
                    "de_read_share": r["read_side_shares"].get("de", 0.0),
                }
            )
    (out / "sweep.json").write_text(
        json.dumps(
            {"rows": table, "results": {f"{p}|{s}": rows[(p, s)] for p, s in sorted(rows)}},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    with (out / "sweep.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    jct = {(p, s): rows[(p, s)]["jct_s"] for p, s in rows}
    plot_sweep(points, systems, jct, out / "sweep.png", "Offline JCT over the sweep")
    print(f"{'point':<28} {'system':<9} {'JCT s':>9} {'×Basic':>7} {'Oracle':>7}")
    for row in table:
        sp = row["speedup_vs_basic"]
        fo = row["fraction_of_oracle"]
        print(
            f"{row['point']:<28} {row['system']:<9} {row['jct_s']:>9.1f} "
            f"{'-' if sp is None else f'{sp:.2f}':>7} {'-' if fo is None else f'{fo:.0%}':>7}"
        )
    print(f"wrote {out}/sweep.json, sweep.csv, sweep.png")
    return 0


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("sweep", help="simulate a grid (presets × P/D × MAL × agents × systems)")
    add_config_args(p)
    p.add_argument("--presets", help="comma-separated cluster presets (default: --preset)")
    p.add_argument("--pd", help="comma-separated P/D shapes, e.g. 1p1d,1p2d,2p1d")
    p.add_argument("--mal", default="64k", help="comma-separated MALs (default 64k)")
    p.add_argument("--agents", default="512", help="comma-separated agent counts (default 512)")
    p.add_argument("--systems", default="basic,dualpath,oracle", help="comma-separated systems")
    p.add_argument("--workers", type=int, default=2, help="parallel processes (default 2)")
    add_ray_arg(p)
    p.add_argument("--out", help="output folder (default: runs/sweep-<hash of the grid>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_sweep)
