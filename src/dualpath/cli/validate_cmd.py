"""`dualpath validate`: the same workload through the real runtime and the simulator.

With ``--gpu-time emulated`` (the default) both run the same hardware preset: the runtime's
engines hold every pass to the cost model's time on it (``runtime.gputime``) and pace every
transfer at its NIC rates, so what is left of the error is the simulator's system model
(queues, network sharing, policy interplay, message latency), not the host.
With ``--gpu-time host``:

1. Profile this host: the runtime model's prefill and decode step times
   (``dualpath.runtime.profile``), fitted into a hardware preset (``models.calibrate``):
   compute and memory constants measured here, NIC rates as the runtime paces them.
2. Run the workload (the runtime bench's agents) through the runtime, every system on a
   fresh KV store.
3. Simulate the same trajectories on the calibrated preset.

Either way it reports per system JCT, TTFT and TPOT of both and the simulator's relative
error, and (emulated) each engine's share of passes that overran their emulated time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from dualpath.cli.background import background_load, load_average
from dualpath.cli.common import add_config_args, build_config
from dualpath.cli.runtime_cmd import (
    DEFAULT_PRESET,
    add_gpu_time_arg,
    format_gpu_use,
    run_runtime_systems,
)
from dualpath.config import Config
from dualpath.metrics import RunSummary, summarize
from dualpath.models.calibrate import Fit, calibrated_hardware, fit

PHASES = ("queue", "alloc", "read", "prefill")


def _err(sim: float, real: float) -> float:
    return (sim - real) / real if real and not math.isnan(real) else float("nan")


def _row(system: str, real: RunSummary, sim: RunSummary) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system}
    for name, r, s in (
        ("jct_s", real.jct_s, sim.jct_s),
        ("ttft_s", real.ttft.mean, sim.ttft.mean),
        ("tpot_s", real.tpot.mean, sim.tpot.mean),
    ):
        row[f"runtime_{name}"] = r
        row[f"sim_{name}"] = s
        row[f"err_{name.removesuffix('_s')}"] = _err(s, r)
    for phase in PHASES:  # where TTFT goes: the error's attribution
        row[f"runtime_{phase}_s"] = getattr(real.breakdown, f"{phase}_s")
        row[f"sim_{phase}_s"] = getattr(sim.breakdown, f"{phase}_s")
    return row


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.1%}"


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:.1f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'system':<9} {'JCT rt s':>9} {'JCT sim s':>9} {'err':>7}  {'TTFT rt ms':>10} "
        f"{'TTFT sim ms':>11} {'err':>7}  {'TPOT rt ms':>10} {'TPOT sim ms':>11} {'err':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['system']:<9} {r['runtime_jct_s']:>9.2f} {r['sim_jct_s']:>9.2f} "
            f"{_pct(r['err_jct']):>7}  {_ms(r['runtime_ttft_s']):>10} {_ms(r['sim_ttft_s']):>11} "
            f"{_pct(r['err_ttft']):>7}  {_ms(r['runtime_tpot_s']):>10} "
            f"{_ms(r['sim_tpot_s']):>11} {_pct(r['err_tpot']):>7}"
        )
    return "\n".join(lines)


def format_breakdown(rows: list[dict[str, Any]]) -> str:
    """Mean TTFT by phase, runtime vs simulator, per system (seconds)."""
    head = f"{'TTFT mean s':<12}" + "".join(f" {p + ' rt':>11} {p + ' sim':>11}" for p in PHASES)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f" {r[f'runtime_{p}_s']:>11.3f} {r[f'sim_{p}_s']:>11.3f}" for p in PHASES)
        lines.append(f"{r['system']:<12}{cells}")
    return "\n".join(lines)


def _toml(hw: Any) -> str:
    lines = [
        "# dualpath validate: hardware calibrated on this host (use with --config)",
        "[hardware]",
    ]
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        lines.append(f'{f.name} = "{value}"' if isinstance(value, str) else f"{f.name} = {value!r}")
    return "\n".join(lines) + "\n"


def bench_config(args: argparse.Namespace) -> Config:
    config = build_config(args)
    rate = args.snic_mb_per_s
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--snic-mb-per-s {rate} is invalid: must be a finite number > 0")
    if getattr(args, "background_load", 0) < 0:
        raise ValueError(f"--background-load {args.background_load} is invalid: must be >= 0")
    for name in ("agents", "turns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} is invalid: must be >= 1")
    hw = config.hardware
    if rate is not None:
        hw = dataclasses.replace(hw, snic_bytes_per_s=rate * 1e6)
    wl = dataclasses.replace(config.workload, num_agents=args.agents)
    return dataclasses.replace(config, hardware=hw, workload=wl)


def run_validate(args: argparse.Namespace) -> int:
    from dualpath.runtime.profile import profile_host
    from dualpath.sim.runner import simulate
    from dualpath.workload.scripts import small_trajectories

    config = bench_config(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise ValueError("--systems is empty: give e.g. basic,dualpath")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {}
    if args.gpu_time == "emulated":  # both run the preset's hardware
        hw = config.hardware
        print(f"emulated GPU time: runtime and simulator on hardware {hw.name!r}")
    else:
        t0 = time.perf_counter()
        prof = profile_host(config.model, config.scheduler.block_tokens)
        f: Fit = fit(config.model, prof.prefill, prof.decode, prof.memory_bytes_per_s)
        hw = calibrated_hardware(config.hardware, config.model, f)
        print(
            f"profile ({time.perf_counter() - t0:.1f} s): prefill "
            f"{f.prefill_overhead_s * 1e3:.2f} ms/pass + GEMM {f.linear_flops_per_s / 1e9:.2f} "
            f"GFLOP/s + attention {f.attention_flops_per_s / 1e9:.2f} GFLOP/s (fit within "
            f"{f.prefill_max_rel_err:.0%}); decode {f.decode_overhead_s * 1e3:.2f} ms/step + "
            f"weights at {f.weight_bytes_per_s / 1e9:.2f} GB/s (copy) + KV at "
            f"{f.kv_bytes_per_s / 1e9:.3f} GB/s (fit within {f.decode_max_rel_err:.0%})"
        )
        payload.update(
            fit=dataclasses.asdict(f),
            memory_bytes_per_s=prof.memory_bytes_per_s,
            prefill_samples=[dataclasses.asdict(s) for s in prof.prefill],
            decode_samples=[dataclasses.asdict(s) for s in prof.decode],
        )
    (out / "hardware.toml").write_text(_toml(hw))
    print(f"wrote {out / 'hardware.toml'}")
    with background_load(args.background_load):
        print(f"runtime: {args.background_load} busy loop(s) beside it; at start: {load_average()}")
        runs = run_runtime_systems(
            config,
            systems,
            args.turns,
            args.token_scale,
            args.max_gen,
            args.kv_root,
            progress=not args.no_progress,
            gpu_time=args.gpu_time,
        )
        print(f"runtime: at end: {load_average()}")
    block = config.scheduler.block_tokens
    trajs = small_trajectories(config.workload, block, args.turns, args.token_scale, args.max_gen)
    sim_config = dataclasses.replace(config, hardware=hw)
    rows = []
    for run in runs:
        result = simulate(sim_config, run.system, config.sim, trajectories=trajs)
        rows.append(_row(run.system, run.summary, summarize(result.records, "offline")))
    print(format_rows(rows))
    print(format_breakdown(rows))
    for run in runs:
        if run.result.gpu_use:
            print(f"{run.system:<9} {format_gpu_use(run.result.gpu_use)}")
    worst = max(abs(r["err_jct"]) for r in rows)
    verdict = "within" if worst <= args.target else "NOT within"
    print(f"JCT error: worst {worst:.1%}, {verdict} the {args.target:.0%} target")
    payload.update(
        gpu_time=args.gpu_time,
        background_load=args.background_load,
        hardware=dataclasses.asdict(hw),
        rows=rows,
        gpu_overrun_share={
            run.system: {k: u.overrun_share for k, u in run.result.gpu_use.items()} for run in runs
        },
    )
    (out / "validate.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out / 'validate.json'}")
    return 0


def add_validate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "validate", help="the same workload through the runtime and the calibrated simulator"
    )
    add_config_args(p, default_preset=DEFAULT_PRESET)
    p.add_argument("--systems", default="basic,dualpath", help="systems to compare")
    p.add_argument("--agents", type=int, default=8, help="agents (default 8)")
    p.add_argument("--turns", type=int, default=6, help="turns per agent (default 6)")
    p.add_argument(
        "--token-scale", type=float, default=0.25, help="scale of the appends of docs/design.md §9"
    )
    p.add_argument("--max-gen", type=int, default=4, help="cap on generated tokens per turn")
    p.add_argument("--snic-mb-per-s", type=float, help="emulated SNIC MB/s (default: the preset's)")
    add_gpu_time_arg(p, "emulated")
    p.add_argument("--kv-root", default="./.dualpath/kv", help="KV store root")
    p.add_argument("--target", type=float, default=0.10, help="JCT error target (0.10)")
    p.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy-loop processes beside the runtime runs (a busy host, on demand; default 0)",
    )
    p.add_argument("--out", default="runs/validate", help="output folder (runs/validate)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_validate)
