"""Online serving (design §9): Poisson agent arrivals, the stop rule, one run's read-out.

Agents arrive as a Poisson process at ``aps`` agents per second and replay their trajectory
(turn i+1 when turn i's last token is out). The driver advances the event loop in steps of
``sample_s``, feeds finished turns to a ``StopRule`` (SLO break or steady state) and samples
every node's SNIC read counter. Arrival times are standard exponential gaps from a
``random.Random(workload.seed)`` divided by ``aps``: runs at different loads share their
random numbers (common random numbers), which keeps capacity search monotone in practice.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpath.config import Config
from dualpath.config.sim import SimConfig
from dualpath.config.systems import system_spec
from dualpath.metrics import TurnRecord, summarize
from dualpath.metrics.slo import SLO, SloCheck, StopReason, StopRule, check_slo
from dualpath.metrics.steady import STEADY_COVERAGE, StorageBound, read_warmup_s
from dualpath.metrics.summary import RunSummary
from dualpath.models import cost
from dualpath.sim.cluster import Cluster
from dualpath.sim.observe import Observer
from dualpath.sim.runner import build_cluster
from dualpath.workload import Trajectory, synthesize
from dualpath.workload.trajectory import turn_requests

# Systems whose policy reads only through the PE nodes' SNICs (design §11: Basic, +Layer).
PE_SIDE_ONLY_POLICIES = ("basic", "layer")


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    """One online run. Arrivals fall in [0, ``horizon_s``) (at most ``max_agents``; 0 = no
    cap) and the run stops at ``horizon_s`` simulated seconds at the latest. The stop rule
    uses ``window_s`` / ``lookback_s`` (paper: 150 s / 1800 s; short runs scale them down),
    ``rel_tol`` and the mean (or ``quantile``) against ``slo``; ``min_samples`` turns must be in
    the window before the SLO can break. Steady state is not declared before ``warmup_s`` +
    lookback + window (both compared windows after the warm-up; ``steady_settings`` derives
    it). ``require_steady``: a run passes only if it reached steady state (the paper's rule;
    a run that ends at the horizon with TTFT still moving fails), else any run without an SLO
    break passes. ``stop_on_steady=False`` runs on past steady state."""

    aps: float
    horizon_s: float = 900.0
    max_agents: int = 0
    window_s: float = 60.0
    lookback_s: float = 180.0
    rel_tol: float = 0.05
    quantile: float | None = None
    min_samples: int = 20
    slo: SLO = field(default_factory=SLO)
    stop_on_steady: bool = True
    sample_s: float = 1.0
    warmup_s: float = 0.0
    require_steady: bool = False

    def __post_init__(self) -> None:
        _require(math.isfinite(self.aps) and self.aps > 0, "aps", self.aps, "> 0")
        _require(self.horizon_s > 0, "horizon_s", self.horizon_s, "> 0")
        _require(self.max_agents >= 0, "max_agents", self.max_agents, ">= 0")
        _require(self.sample_s > 0, "sample_s", self.sample_s, "> 0")
        _require(self.warmup_s >= 0, "warmup_s", self.warmup_s, ">= 0")

    def stop_rule(self) -> StopRule:
        """The rule; without ``stop_on_steady`` its lookback never ends (SLO breaks only)."""
        lookback = self.lookback_s if self.stop_on_steady else 1e18
        return StopRule(
            self.slo,
            self.window_s,
            lookback,
            self.rel_tol,
            self.quantile,
            self.min_samples,
            self.warmup_s,
        )


def base_trajectories(config: Config) -> list[Trajectory]:
    """The workload's base trajectories (one per base trajectory of the config, seeded)."""
    workload = dataclasses.replace(
        config.workload, num_agents=config.workload.num_base_trajectories
    )
    return synthesize(workload, config.scheduler.block_tokens)


def steady_settings(
    config: Config, settings: OnlineSettings, coverage: float = STEADY_COVERAGE, checks: int = 2
) -> OnlineSettings:
    """``settings`` with a warm-up and horizon long enough for agents to live whole lives.

    Each turn is taken to last as long as a turn that just meets the SLO may: TTFT
    ``slo.ttft_s`` then ``output − 1`` tokens at ``slo.tpot_s`` (an upper bound, so the
    warm-up is conservative). The warm-up is the time the expected storage read rate of
    Poisson arrivals takes to reach ``coverage`` of its steady value (``read_warmup_s`` over
    the workload's turn counts, hits and outputs). The steady-state comparison (both windows
    after the warm-up) can first be made at warm-up + lookback + window; the horizon gives it
    ``checks`` such spans (a cost cap: a run that reaches it without a steady verdict fails,
    ``require_steady``)."""
    slo, kv = settings.slo, cost.kv_bytes_per_token(config.model)
    block = config.scheduler.block_tokens
    agents = [
        [
            (slo.ttft_s + max(0, s.output_tokens - 1) * slo.tpot_s, s.hit_tokens * kv)
            for s in turn_requests(t, block)
        ]
        for t in base_trajectories(config)
    ]
    _require(checks >= 1, "checks", checks, ">= 1")
    warmup = read_warmup_s(agents, coverage)
    horizon = warmup + checks * (settings.lookback_s + settings.window_s)
    return dataclasses.replace(settings, warmup_s=warmup, horizon_s=horizon, require_steady=True)


def storage_bound(config: Config, system: str) -> StorageBound:
    """The highest steady load ``system`` can sustain on storage alone: mean hit KV bytes per
    agent (the workload's base trajectories) over the read bandwidth of the SNICs it reads
    through (PE nodes only for Basic / +Layer, every node otherwise; the Oracle's reads are
    free), capped by ``hardware.storage_read_bytes_per_s`` when set."""
    spec = system_spec(system)
    trajs = base_trajectories(config)
    kv, block = cost.kv_bytes_per_token(config.model), config.scheduler.block_tokens
    hit_bytes = math.fsum(
        sum(s.hit_tokens for s in turn_requests(t, block)) * kv for t in trajs
    ) / max(1, len(trajs))
    cl, hw = config.cluster, config.hardware
    nodes = cl.num_prefill_nodes
    if spec.policy not in PE_SIDE_ONLY_POLICIES:
        nodes += cl.num_decode_nodes
    read = math.inf if spec.oracle else nodes * hw.snic_total_bytes_per_s
    if hw.storage_read_bytes_per_s > 0:
        read = min(read, hw.storage_read_bytes_per_s)
    return StorageBound(hit_bytes, read)


def poisson_arrivals(
    rng: random.Random, aps: float, horizon_s: float, max_agents: int = 0
) -> list[float]:
    """Arrival times of a Poisson process of rate ``aps`` in [0, horizon_s), in order."""
    _require(aps > 0, "aps", aps, "> 0")
    out: list[float] = []
    t = rng.expovariate(1.0) / aps
    while t < horizon_s and (max_agents == 0 or len(out) < max_agents):
        out.append(t)
        t += rng.expovariate(1.0) / aps
    return out


@dataclass(frozen=True, slots=True)
class OnlineResult:
    """``passed``: the stop rule saw no SLO break in any window (``slo_check``: the whole
    run's statistic, reported).
    ``snic_samples``: (time s, cumulative SNIC read bytes per node); ``attention``: per prefill
    forward of an EP group, (start s, attention s per GPU)."""

    system: str
    aps: float
    num_agents: int
    stop_reason: str  # a StopReason value, "horizon" or "all_done"
    stopped_at_s: float
    passed: bool
    slo_check: SloCheck
    summary: RunSummary
    records: tuple[TurnRecord, ...] = field(repr=False, default=())
    snic_samples: tuple[tuple[float, list[float]], ...] = field(repr=False, default=())
    attention: tuple[tuple[float, list[float]], ...] = field(repr=False, default=())
    observer: Observer | None = field(repr=False, default=None)

    def to_dict(self) -> dict[str, object]:
        return {
            "system": self.system,
            "aps": self.aps,
            "num_agents": self.num_agents,
            "stop_reason": self.stop_reason,
            "stopped_at_s": self.stopped_at_s,
            "passed": self.passed,
            "slo": dataclasses.asdict(self.slo_check),
            "summary": self.summary.to_dict(),
        }


def online_workload(
    config: Config, settings: OnlineSettings
) -> tuple[list[Trajectory], list[float]]:
    """Seeded trajectories and their Poisson arrival times for ``settings.aps``."""
    rng = random.Random(config.workload.seed)
    arrivals = poisson_arrivals(rng, settings.aps, settings.horizon_s, settings.max_agents)
    if not arrivals:
        arrivals = [0.0]
    workload = dataclasses.replace(config.workload, num_agents=len(arrivals))
    return synthesize(workload, config.scheduler.block_tokens), arrivals


def run_online(
    config: Config,
    system: str,
    settings: OnlineSettings,
    sim: SimConfig | None = None,
    spans: bool = False,
    workload: tuple[Sequence[Trajectory], Sequence[float]] | None = None,
) -> OnlineResult:
    """One online run of ``system``: seeded Poisson arrivals (or ``workload`` =
    (trajectories, arrival times)), stopped by the stop rule, the horizon or completion."""
    trajs, arrivals = online_workload(config, settings) if workload is None else workload
    cluster = build_cluster(config, system, sim, trajs, arrivals)
    return run_built(cluster, system, settings, len(arrivals), spans)


def run_built(
    cluster: Cluster, system: str, settings: OnlineSettings, num_agents: int, spans: bool = False
) -> OnlineResult:
    """Drive an already built cluster (agents added) as an online run; read it out."""
    observer = Observer(cluster, spans=spans)
    reason, stopped = drive(cluster, observer, settings)
    records = tuple(sorted(cluster.records, key=lambda r: r.request_id))
    if not records:
        raise RuntimeError(f"online run of {system} at {settings.aps} APS finished no turn")
    check = check_slo(records, settings.slo, settings.quantile)
    # the SLO is checked in windows (the stop rule), as the paper does; ``check`` (the
    # whole run's statistic) is reported, not judged
    broke = reason in (StopReason.TTFT_OVER_SLO.value, StopReason.TPOT_OVER_SLO.value)
    steady = reason == StopReason.STEADY_STATE.value
    return OnlineResult(
        system,
        settings.aps,
        num_agents,
        reason,
        stopped,
        passed=not broke and (steady or not settings.require_steady),
        slo_check=check,
        summary=summarize(records, "online"),
        records=records,
        snic_samples=tuple(observer.snic_samples),
        attention=tuple(observer.attention),
        observer=observer,
    )


def drive(cluster: Cluster, observer: Observer, settings: OnlineSettings) -> tuple[str, float]:
    """Advance ``cluster`` in steps of ``settings.sample_s`` until a stop; (reason, time s)."""
    loop, rule = cluster.loop, settings.stop_rule()
    seen = 0
    observer.sample_snic()
    while True:
        until = min(loop.now + settings.sample_s, settings.horizon_s)
        loop.run(until_s=until)
        observer.sample_snic()
        fresh = sorted(cluster.records[seen:], key=lambda r: (r.finish_s, r.request_id))
        seen = len(cluster.records)
        for record in fresh:
            reason = rule.observe(record)
            if reason is not None:
                return reason.value, record.finish_s
        if cluster.num_turns_done == cluster.num_turns_total:
            return "all_done", loop.now
        if loop.now >= settings.horizon_s or loop.num_pending == 0:
            return "horizon", loop.now
