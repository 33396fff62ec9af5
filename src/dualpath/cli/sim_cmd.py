"""`dualpath sim` and `dualpath sweep`: run the cluster simulator and write its results.

Config: preset → TOML → ``--set`` (``sim.*`` keys go to ``SimConfig``); every mistake is a
``ValueError`` (main.py prints one line, exit 2). Output folder: config.json, results.json,
results.csv and a PNG plot (sweep: sweep.json, sweep.csv, sweep.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dualpath.api import Axis, Choice, Simulation, setting_title, sweep
from dualpath.api.grid import parse_set
from dualpath.cli.common import add_cache_args, add_config_args, add_ray_arg, cache_from_args
from dualpath.config import Config, apply_overrides, config_for, load_toml, preset
from dualpath.config.loader import model_swap_note
from dualpath.config.sim import SimConfig, parse_systems
from dualpath.config.systems import system_spec
from dualpath.progress import bar
from dualpath.sim.cache import ResultCache
from dualpath.sim.jobs import offline_job
from dualpath.sim.report import format_table, order_systems
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
    before = config
    config = apply_overrides(config, [*args.overrides, *flags])
    note = model_swap_note(before, config)
    if note:
        print(note, file=sys.stderr)
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
def run_systems(
    config: Config, sim: SimConfig, progress: bool = True, cache: ResultCache | None = None
) -> dict[str, SimResult]:
    """Every system of ``sim.systems`` on the same config (workload, seed, cost model); each
    read from ``cache`` when it holds that run, else simulated (a progress bar per system)
    and cached."""
    for name in sim.system_list:  # a scheduler.policy no system may run: fail before any
        config_for(config, system_spec(name))
    cache = cache if cache is not None else ResultCache(None)
    results: dict[str, SimResult] = {}
    for name in order_systems(sim.system_list):
        job = offline_job(config, name, sim)
        hit = cache.get(job.key)
        if hit is not None:
            if progress:
                print(f"{name}: from the cache ({cache.folder})", file=sys.stderr)
            results[name] = hit
            continue
        with bar(None, f"{name:<8}", "turn", disable=not progress) as pbar:

            def tick(now: float, done: int, total: int, pbar: Any = pbar) -> None:
                pbar.total = total
                pbar.update(done - pbar.n)
                pbar.set_postfix_str(f"sim {now:,.0f} s")

            results[name] = simulate(config, name, sim, progress=tick)
        cache.put(job.key, results[name])
    return results


def write_outputs(
    out: Path, config: Config, sim: SimConfig, results: dict[str, SimResult], title: str
) -> list[Path]:
    """config.json, results.json, results.csv, jct.png under ``out``; returns the paths."""
    simulation = Simulation(dataclasses.replace(config, sim=sim), results)
    return simulation.write(out, title)


def _title(config: Config) -> str:
    return setting_title(config)


def run_sim(args: argparse.Namespace) -> int:
    config, sim = build_inputs(args)
    out = Path(args.out or sim.out_dir or default_out_dir(config, sim, args.overrides))
    cache = cache_from_args(args)
    t0 = time.perf_counter()
    results = run_systems(config, sim, progress=not args.no_progress, cache=cache)
    wall = time.perf_counter() - t0
    files = write_outputs(out, config, sim, results, _title(config))
    print(format_table(results, _title(config)))
    print(f"wall {wall:.1f} s ({cache.describe()}); wrote " + ", ".join(str(f) for f in files))
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
        no_cache=True,  # the main job always simulates (it is what `make run` shows)
    )
    return run_sim(args)


def add_sim_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "sim", help="simulate the cluster offline: DualPath vs Basic vs Oracle (docs/design.md §11)"
    )
    add_config_args(p)
    p.add_argument("--agents", type=int, help="number of agents (workload.num_agents)")
    p.add_argument("--mal", help="maximum agent context length: 32k, 48k or 64k")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument(
        "--systems",
        help="comma-separated: basic, layer, dpl, dualpath, oracle; the field's designs "
        "recompute, d2p, d2p-evictable, both-read, dram-tier and dualpath-resident "
        "(docs/peers.md) (default: basic,dualpath,oracle)",
    )
    p.add_argument("--no-traffic-manager", action="store_true", help="one traffic class")
    p.add_argument("--out", help="output folder (default: runs/<derived name>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cache_args(p)
    p.set_defaults(func=run_sim)


# ---------------------------------------------------------------------- sweep
def _pd_overrides(text: str) -> list[str]:
    low = text.strip().lower()
    try:
        p, d = low.rstrip("d").split("p")
        return [f"cluster.num_prefill_nodes={int(p)}", f"cluster.num_decode_nodes={int(d)}"]
    except ValueError:
        raise ValueError(f"--pd {text!r} is invalid: must look like 1p2d") from None


def _listed(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def sweep_axes(args: argparse.Namespace) -> tuple[list[Axis], list[str]]:
    """(grid axes, fixed overrides). Axes: --presets, --pd, --mal, --agents (the preset /
    P/D / MAL / agents grid of before), then every ``--set key=v1,v2`` with more than one
    value, in the order given (the first axis varies slowest). ``--set`` wins over the
    --mal/--agents defaults; a --set with one value is a fixed override."""
    presets = _listed(args.presets or args.preset)
    for name in presets:
        preset(name)  # ValueError early
    axes = [Axis("preset", tuple(Choice(n, (f"preset={n}",)) for n in presets))]
    if args.pd:
        axes.append(
            Axis(
                "cluster.pd", tuple(Choice(pd, tuple(_pd_overrides(pd))) for pd in _listed(args.pd))
            )
        )
    fixed: list[str] = []
    grid: list[Axis] = []
    set_keys = set()
    for text in args.overrides:
        key, values = parse_set(text)
        set_keys.add(key)
        if len(values) == 1:
            fixed.append(f"{key}={values[0]}")
        else:
            grid.append(Axis.of(key, values))
    if "workload.mal" not in set_keys:
        mals = [m.lower() for m in _listed(args.mal)]
        axes.append(Axis("workload.mal", tuple(Choice(m, (f"workload.mal={m}",)) for m in mals)))
    if "workload.num_agents" not in set_keys:
        agents = [str(int(parse_tokens(a))) for a in _listed(args.agents)]
        axes.append(
            Axis(
                "workload.num_agents",
                tuple(Choice(a, (f"workload.num_agents={a}",)) for a in agents),
            )
        )
    # preset first (it replaces the config), then the fixed --set, then the other axes
    axes = [axes[0], Axis("fixed", (Choice("", tuple(fixed)),), hidden=True), *axes[1:], *grid]
    return axes, fixed


def run_sweep(args: argparse.Namespace) -> int:
    axes, _ = sweep_axes(args)
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} is invalid: must be >= 1")
    cache = cache_from_args(args)
    t0 = time.perf_counter()
    result = sweep(
        preset(args.preset),
        axes,
        args.systems,
        cache=cache,
        workers=args.workers,
        ray_address=args.ray_address,
        progress=not args.no_progress,
    )
    wall = time.perf_counter() - t0
    name_hash = hashlib.sha256(
        json.dumps([[c.overrides for c in a.choices] for a in axes]).encode()
        + json.dumps(args.systems).encode()
    ).hexdigest()[:10]
    out = Path(args.out or Path("runs") / f"sweep-{name_hash}")
    base = result.points[0].config
    title = f"Offline JCT over the sweep: {base.model.name}, seed {base.workload.seed}"
    files = result.write(out, title)
    print(f"{'point':<44} {'system':<9} {'JCT s':>9} {'×Basic':>7} {'Oracle':>7}")
    for row in result.rows():
        sp = row["speedup_vs_basic"]
        fo = row["fraction_of_oracle"]
        print(
            f"{row['point']:<44} {row['system']:<9} {row['jct_s']:>9.1f} "
            f"{'-' if sp is None else f'{sp:.2f}':>7} {'-' if fo is None else f'{fo:.0%}':>7}"
        )
    print(
        f"{len(result.points)} points x {len(result.systems)} systems: {result.simulated} "
        f"simulated, {result.from_cache} from the cache ({cache.folder or 'off'}); wall "
        f"{wall:.1f} s"
    )
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "sweep",
        help="simulate a grid: any --set key=v1,v2 (several keys: their product), presets, "
        "P/D, MAL, agents, systems",
    )
    add_config_args(p)
    p.add_argument("--presets", help="comma-separated cluster presets (default: --preset)")
    p.add_argument("--pd", help="comma-separated P/D shapes, e.g. 1p1d,1p2d,2p1d")
    p.add_argument("--mal", default="64k", help="comma-separated MALs (default 64k)")
    p.add_argument("--agents", default="512", help="comma-separated agent counts (default 512)")
    p.add_argument("--systems", default="basic,dualpath,oracle", help="comma-separated systems")
    p.add_argument("--workers", type=int, default=2, help="parallel processes (default 2)")
    add_ray_arg(p)
    add_cache_args(p)
    p.add_argument("--out", help="output folder (default: runs/sweep-<hash of the grid>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_sweep)
