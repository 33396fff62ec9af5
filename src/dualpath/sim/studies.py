"""Studies built on online and offline runs (design §12): capacity, ablation, trace replay,
load balance series. Each is a loop of seeded simulations; nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from dualpath.config import Config
from dualpath.config.sim import SimConfig
from dualpath.config.systems import system_spec
from dualpath.metrics.balance import windowed_max_over_avg
from dualpath.metrics.breakdown import attention_balance, rates_from_counters
from dualpath.metrics.capacity import CapacityResult, find_capacity
from dualpath.sim.cluster import Cluster
from dualpath.sim.online import (
    OnlineResult,
    OnlineSettings,
    run_built,
    run_online,
    storage_bound,
)
from dualpath.sim.runner import simulate
from dualpath.workload import TurnSpec
from dualpath.workload.mooncake import TraceRequest, load_mooncake

ABLATION_STEPS = (("basic", "Basic"), ("layer", "+Layer"), ("dpl", "+DPL"), ("dualpath", "+Sched"))
ProbeHook = Callable[[str, float, OnlineResult], None]
# runs one online probe: (config, system, settings, sim) → result (e.g. through a cache)
OnlineRunner = Callable[[Config, str, OnlineSettings, SimConfig | None], OnlineResult]


def capacity(
    config: Config,
    system: str,
    settings: OnlineSettings,
    lo_aps: float,
    hi_aps: float,
    rel_tol: float = 0.05,
    max_iter: int = 12,
    sim: SimConfig | None = None,
    on_probe: ProbeHook | None = None,
    runner: OnlineRunner | None = None,
) -> CapacityResult:
    """Highest APS at which an online run of ``system`` meets the SLO (bisection; each probe
    is one seeded run of ``settings`` with its ``aps`` replaced). A load above the system's
    storage bound (``online.storage_bound``) fails without a run: arrivals there outpace the
    SNICs, so no steady state exists (a finite run of closed-loop agents only shows the
    backlog growing slowly: the population grows at λ − bound). ValueError if the capacity
    found still exceeds the bound (a guard: it is never reported). ``runner`` runs each probe
    (default ``run_online``; the CLI passes one that reads and fills the result cache)."""
    bound = storage_bound(config, system)
    run = runner if runner is not None else run_online

    def passes(aps: float) -> bool:
        if aps > bound.aps:
            return False
        result = run(config, system, dataclasses.replace(settings, aps=aps), sim)
        if on_probe is not None:
            on_probe(system, aps, result)
        return result.passed

    result = find_capacity(passes, lo_aps, hi_aps, rel_tol, max_iter)
    bound.check(result.capacity_aps, f"{config.name} {system}")
    return result


def ablation(
    config: Config,
    sim: SimConfig | None = None,
    progress: Callable[[str], None] | None = None,
    jct_of: Callable[[str], float] | None = None,
) -> list[dict[str, object]]:
    """Offline JCT of Basic, +Layer, +DPL, +Sched (= DualPath) on ``config`` and the speed-up
    of each over Basic and over the previous step (``jct_of(system)``: JCTs simulated
    already, e.g. in parallel; else one simulation per step here)."""
    rows: list[dict[str, object]] = []
    base = prev = 0.0
    for system, label in ABLATION_STEPS:
        if progress is not None:
            progress(label)
        jct = jct_of(system) if jct_of is not None else simulate(config, system, sim).jct_s
        base = base or jct
        rows.append(
            {
                "system": label,
                "sim_system": system,
                "jct_s": jct,
                "speedup_vs_basic": base / jct,
                "speedup_vs_prev": (prev / jct) if prev else 1.0,
            }
        )
        prev = jct
    return rows


def run_trace(
    config: Config,
    system: str,
    requests: Sequence[TraceRequest],
    settings: OnlineSettings,
    speedup: float = 1.0,
    sim: SimConfig | None = None,
) -> OnlineResult:
    """Online replay of a Mooncake trace: each request is a one-turn agent arriving at
    ``timestamp / speedup`` with the trace's own hit prefix (an earlier request stored it;
    the trace, not the simulator, decides hits). Requests arriving at or after
    ``settings.horizon_s`` are left out; ``settings.aps`` is only a label."""
    if speedup <= 0:
        raise ValueError(f"trace_speedup={speedup!r} is invalid: must be > 0")
    if sim is None:
        own = getattr(config, "sim", None)
        sim = own if isinstance(own, SimConfig) else SimConfig()
    cluster = Cluster(config, system_spec(system), sim)
    num = 0
    for r in requests:
        start = r.timestamp_s / speedup
        if start >= settings.horizon_s:
            continue
        spec = TurnSpec(0, r.prompt_tokens, r.hit_tokens, r.output_tokens)
        cluster.add_agent(num, [spec], start)
        num += 1
    if num == 0:
        raise ValueError("trace has no request before the horizon")
    return run_built(cluster, system, settings, num)


def load_trace(path: str | Path, block_tokens: int) -> list[TraceRequest]:
    """``load_mooncake`` with a one-line error for a missing file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace={str(p)!r} is invalid: no such file")
    return load_mooncake(p, block_tokens)


def snic_series(result: OnlineResult, window_s: float) -> list[tuple[float, float]]:
    """SNIC read max/avg across all nodes in sliding windows of ``window_s`` (from the
    run's 1-sample-per-step counters); windows in which no SNIC read anything are left out
    (no reads is no data, not perfect balance)."""
    rates = rates_from_counters(list(result.snic_samples))
    return windowed_max_over_avg(rates, window_s, skip_idle=True)


def attention_series(result: OnlineResult) -> list[tuple[float, float]]:
    """Per prefill forward of the EP group: attention max/avg across its GPUs (forwards in
    which no GPU attended anything left out)."""
    return attention_balance(result.attention, skip_idle=True)
