"""`dualpath online | capacity | ablation | replay | trace`: online-serving studies.

Config as for `dualpath sim` (preset → TOML → ``--set``); the online knobs (horizon, stop
rule window/lookback, SLO) are flags. Every mistake is a one-line ``ValueError``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dualpath.cli.common import add_cache_args, add_config_args, cache_from_args
from dualpath.cli.sim_cmd import build_inputs
from dualpath.config import Config
from dualpath.config.sim import parse_systems
from dualpath.metrics.slo import SLO
from dualpath.metrics.steady import STEADY_COVERAGE
from dualpath.progress import bar as progress_bar
from dualpath.sim.cache import ResultCache, run_meta
from dualpath.sim.jobs import offline_job, online_job, run_jobs
from dualpath.sim.online import (
    OnlineResult,
    OnlineSettings,
    run_online,
    steady_settings,
    storage_bound,
)
from dualpath.sim.results import SimResult

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"


def add_online_args(p: argparse.ArgumentParser, systems: str = "basic,dualpath") -> None:
    add_config_args(p)
    p.add_argument("--mal", help="maximum agent context length: 32k, 48k or 64k")
    p.add_argument("--seed", type=int, help="workload seed (arrivals and trajectories)")
    p.add_argument(
        "--systems", default=systems, help=f"comma-separated systems (default {systems})"
    )
    p.add_argument(
        "--horizon-s",
        type=float,
        help="arrivals and run end (online/capacity default: derived so that agents live "
        "whole lives, see docs/online.md; replay/trace default 900)",
    )
    p.add_argument("--max-agents", type=int, default=0, help="cap on arriving agents (0 = none)")
    p.add_argument("--window-s", type=float, default=60.0, help="stop-rule window (paper 150)")
    p.add_argument("--lookback-s", type=float, default=180.0, help="steady lookback (paper 1800)")
    p.add_argument("--ttft-slo", type=float, default=4.0, help="TTFT SLO in s (4)")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="TPOT SLO in s (0.05)")
    p.add_argument("--quantile", type=float, help="SLO statistic percentile (default: mean)")
    p.add_argument("--no-steady-stop", action="store_true", help="run to the horizon")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def online_settings(
    args: argparse.Namespace, aps: float = 1.0, config: Config | None = None
) -> OnlineSettings:
    """The flags' settings; without ``--horizon-s`` and with ``config`` (online, capacity)
    the warm-up and horizon are derived from the workload (``steady_settings``)."""
    settings = OnlineSettings(
        aps=aps,
        horizon_s=900.0 if args.horizon_s is None else args.horizon_s,
        max_agents=args.max_agents,
        window_s=args.window_s,
        lookback_s=args.lookback_s,
        quantile=args.quantile,
        slo=SLO(args.ttft_slo, args.tpot_slo),
        stop_on_steady=not args.no_steady_stop,
    )
    if args.horizon_s is None and config is not None:
        settings = steady_settings(config, settings)
        print(
            f"steady state: warm-up {settings.warmup_s:.0f} s (storage read rate at "
            f"{STEADY_COVERAGE:.0%} of its steady value), horizon {settings.horizon_s:.0f} s"
        )
    return settings


def latency_row(r: OnlineResult) -> dict[str, Any]:
    s = r.summary
    b = s.breakdown
    return {
        "system": r.system,
        "aps": r.aps,
        "agents": r.num_agents,
        "stop": r.stop_reason,
        "stopped_at_s": round(r.stopped_at_s, 3),
        "passed": r.passed,
        "ttft_s": s.ttft.mean,
        "ttft_p90_s": s.ttft.p90,
        "ttst_s": s.ttst.mean,
        "tpot_s": s.tpot.mean if s.tpot.count else None,
        "agent_jct_p50_s": s.agent_jct.p50,
        "queue_s": b.queue_s,
        "alloc_s": b.alloc_s,
        "read_s": b.read_s,
        "prefill_s": b.prefill_s,
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def print_rows(rows: list[dict[str, Any]], columns: list[str]) -> None:
    table = [columns] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def _write(out: str | None, name: str, rows: Any, config: Config, settings: Any = None) -> None:
    """``{"run": resolved config, seed, code version (and the run settings), "rows": rows}``."""
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        run = run_meta(config)
        if settings is not None:
            run["settings"] = dataclasses.asdict(settings)
        payload = {"run": run, "rows": rows}
        (path / name).write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path / name}")


def _cached_runner(args: argparse.Namespace) -> tuple[ResultCache, Any]:
    """The shared result cache and an online runner that reads and fills it."""
    cache = cache_from_args(args)

    def run(config: Config, system: str, settings: OnlineSettings, sim: Any) -> OnlineResult:
        job = online_job(config, system, settings, sim)
        result: OnlineResult = run_jobs([job], cache, show_progress=False)[0]
        return result

    return cache, run


# ---------------------------------------------------------------------- online
def run_online_cmd(args: argparse.Namespace) -> int:
    config, sim = build_inputs(args)
    settings = online_settings(args, args.aps, config)
    cache, run = _cached_runner(args)
    rows = []
    for system in parse_systems(args.systems):
        rows.append(latency_row(run(config, system, settings, sim)))
    print_rows(rows, list(rows[0]))
    print(cache.describe())
    _write(args.out, "online.json", rows, config, settings)
    return 0


def add_online_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("online", help="online serving at one APS: TTFT/TTST/TPOT, breakdown")
    add_online_args(p)
    p.add_argument("--aps", type=float, required=True, help="agents per second (Poisson)")
    p.add_argument("--out", help="folder for online.json")
    add_cache_args(p)
    p.set_defaults(func=run_online_cmd)


# ---------------------------------------------------------------------- capacity
def run_capacity_cmd(args: argparse.Namespace) -> int:
    from dualpath.sim.studies import capacity

    config, sim = build_inputs(args)
    settings = online_settings(args, 1.0, config)
    systems = parse_systems(args.systems)
    if not 0 < args.lo < args.hi:
        raise ValueError(f"--lo={args.lo} / --hi={args.hi} is invalid: must be 0 < lo < hi")
    rows: list[dict[str, Any]] = []
    cache, run = _cached_runner(args)
    bar = progress_bar(len(systems) * args.max_probes, "capacity", "probe", args.no_progress)

    def hook(system: str, aps: float, r: OnlineResult) -> None:
        bar.update(1)
        verdict = "pass" if r.passed else "fail"
        bar.set_postfix_str(f"{system} {aps:.3g} APS {verdict}")
        if args.no_progress:  # one line per probe instead of the bar
            print(
                f"  probe {system} {aps:.4g} APS: {verdict} (stop {r.stop_reason} at "
                f"{r.stopped_at_s:.0f} s, TTFT {r.slo_check.ttft_s:.3f} s, TPOT "
                f"{r.slo_check.tpot_s * 1e3:.1f} ms, {r.num_agents} agents)",
                flush=True,
            )

    for system in systems:
        res = capacity(
            config, system, settings, args.lo, args.hi, args.tol, args.max_probes, sim, hook, run
        )
        bound = storage_bound(config, system)
        rows.append(
            {
                "setting": config.name,
                "system": system,
                **res.to_dict(),
                "storage_bound_aps": None if math.isinf(bound.aps) else bound.aps,
            }
        )
    bar.close()
    print_rows(
        rows, ["setting", "system", "capacity_aps", "upper_aps", "converged", "storage_bound_aps"]
    )
    for r in rows:  # studies.capacity has already refused any capacity above its bound
        print(
            f"storage bound {r['system']}: capacity {r['capacity_aps']:.4g} APS <= "
            f"{_fmt(r['storage_bound_aps'])} APS (arrival rate x hit bytes per agent <= "
            "SNIC read bandwidth): ok"
        )
    by = {r["system"]: r["capacity_aps"] for r in rows}
    if by.get("basic") and "dualpath" in by:
        print(f"DualPath/Basic capacity ratio: {by['dualpath'] / by['basic']:.2f}x")
    print(cache.describe())
    _write(args.out, "capacity.json", rows, config, settings)
    return 0


def add_capacity_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("capacity", help="highest APS within the SLO per system (bisection)")
    add_online_args(p)
    p.add_argument("--lo", type=float, default=1.0, help="first low APS probe (1)")
    p.add_argument("--hi", type=float, default=4.0, help="first high APS probe (4)")
    p.add_argument("--tol", type=float, default=0.1, help="relative bracket width to stop (0.1)")
    p.add_argument("--max-probes", type=int, default=10, help="online runs per system (10)")
    p.add_argument("--out", help="folder for capacity.json")
    add_cache_args(p)
    p.set_defaults(func=run_capacity_cmd)


# ---------------------------------------------------------------------- ablation
def run_ablation_cmd(args: argparse.Namespace) -> int:
    from dualpath.sim.studies import ablation

    config, sim = build_inputs(args)

    def progress(label: str) -> None:
        if not args.no_progress:
            print(f"running {label} ...", flush=True)

    cache = cache_from_args(args)

    def jct_of(system: str) -> float:
        result: SimResult = run_jobs(
            [offline_job(config, system, sim)], cache, show_progress=False
        )[0]
        return result.jct_s

    rows = ablation(config, sim, progress, jct_of)
    print_rows(rows, ["system", "sim_system", "jct_s", "speedup_vs_basic", "speedup_vs_prev"])
    print(cache.describe())
    _write(args.out, "ablation.json", rows, config)
    return 0


def add_ablation_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("ablation", help="offline JCT of Basic, +Layer, +DPL, +Sched (DualPath)")
    add_config_args(p)
    p.add_argument("--agents", type=int, help="number of agents (workload.num_agents)")
    p.add_argument("--mal", help="maximum agent context length: 32k, 48k or 64k")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--out", help="folder for ablation.json")
    p.add_argument("--no-progress", action="store_true")
    add_cache_args(p)
    p.set_defaults(func=run_ablation_cmd)


# ---------------------------------------------------------------------- replay
def run_replay_cmd(args: argparse.Namespace) -> int:
    from dualpath.sim.studies import load_trace, run_trace

    config, sim = build_inputs(args)
    path = Path(args.trace_file) if args.trace_file else DEFAULT_TRACE / args.trace_name
    requests = load_trace(path, config.scheduler.block_tokens)
    speedups = [float(x) for x in str(args.speedup).split(",") if x.strip()]
    rows = []
    for speedup in speedups:
        settings = dataclasses.replace(online_settings(args), aps=speedup)
        for system in parse_systems(args.systems):
            row = latency_row(run_trace(config, system, requests, settings, speedup, sim))
            row["speedup"] = row.pop("aps")
            rows.append(row)
    print_rows(
        rows,
        [
            "system",
            "speedup",
            "agents",
            "stop",
            "ttft_s",
            "ttst_s",
            "tpot_s",
            "queue_s",
            "read_s",
            "prefill_s",
        ],
    )
    _write(args.out, "replay.json", rows, config, online_settings(args))
    return 0


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("replay", help="replay a Mooncake trace online (own timestamps, sped up)")
    add_online_args(p)
    p.add_argument("--trace-file", help="Mooncake JSONL (default: ../shared/traces/NAME)")
    p.add_argument("--trace-name", default="mooncake_conversation_trace.jsonl")
    p.add_argument("--speedup", default="1", help="comma-separated speed-up factors (1)")
    p.add_argument("--out", help="folder for replay.json")
    p.set_defaults(func=run_replay_cmd, horizon_s=600.0, no_steady_stop=True)


# ---------------------------------------------------------------------- chrome trace
def run_trace_cmd(args: argparse.Namespace) -> int:
    from dualpath.sim.trace_export import export_trace

    config, sim = build_inputs(args)
    if args.decode_steps:  # one event per decode step: the same timeline (docs/simulator.md)
        sim = dataclasses.replace(sim, decode_macro_steps=1)
    system = parse_systems(args.systems)[0]
    settings = online_settings(args, args.aps)
    result = run_online(config, system, settings, sim, spans=True)
    path = export_trace(result, args.out)
    assert result.observer is not None
    print(
        f"wrote {path}: {len(result.observer.spans)} spans, {system} at {args.aps} APS, "
        f"{result.stopped_at_s:.1f} s simulated (open in https://ui.perfetto.dev)"
    )
    return 0


def add_trace_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser("trace", help="Chrome/Perfetto trace of one short online run")
    add_online_args(p, systems="dualpath")
    p.add_argument("--aps", type=float, default=1.0, help="agents per second (1)")
    p.add_argument("--out", default="runs/trace.json", help="trace file (runs/trace.json)")
    p.add_argument(
        "--decode-steps",
        action="store_true",
        help="one decode span per step (sim.decode_macro_steps=1; default: up to 64 per span)",
    )
    p.set_defaults(func=run_trace_cmd, horizon_s=60.0, no_steady_stop=True)
