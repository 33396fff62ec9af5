"""The simulator-backed ``FigureData`` provider of `dualpath figures` (docs/online.md).

``make_figure_data(quick)`` returns a provider that runs every simulation the figures need
up front through the shared result cache (``sim.cache``, ``sim.jobs``); its methods read
them. ``quick`` = small storage-bound settings (a 50 Gb/s SNIC) that finish in about 85 s
on 2 busy cores (docs/online.md, "Figures"); full = paper-like settings (long). Every number
comes from a seeded simulation; nothing is tuned to the paper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.config import Config, apply_overrides, preset
from dualpath.metrics.breakdown import mean_breakdown
from dualpath.metrics.capacity import CapacityResult
from dualpath.metrics.slo import SLO
from dualpath.sim.cache import ResultCache, cache_key, code_version, run_meta
from dualpath.sim.jobs import Job, offline_job, online_job, run_jobs
from dualpath.sim.online import OnlineResult, OnlineSettings, run_online, storage_bound
from dualpath.sim.runner import simulate
from dualpath.sim.studies import (
    ABLATION_STEPS,
    ablation,
    attention_series,
    capacity,
    snic_series,
)
from dualpath.workload import Trajectory, synthesize

_LABEL = {"basic": "Basic", "dualpath": "DualPath", "oracle": "Oracle", "dpl": "DPL (RR)"}


@dataclass(frozen=True, slots=True)
class FigureSettings:
    """What each figure simulates. ``online_preset`` at each of ``aps`` for latency and the
    breakdown; ``balance_preset`` with ``balance_agents`` agents started together (a
    storage-bound offline batch, observed for ``balance_horizon_s``; DualPath vs DPL =
    round-robin engine and read-side choice) for the load-balance series; ``capacity_search`` runs bisection
    per system, else capacity = the highest passing APS of the latency sweep (``aps``: fine
    enough near the capacities for the ratio to mean something)."""

    offline: tuple[tuple[str, str, int], ...]  # (preset, MAL, agents)
    pd_presets: tuple[str, ...]
    pd_agents: int
    ablation: tuple[str, str, int]
    online_preset: str
    aps: tuple[float, ...]
    online: OnlineSettings
    balance_preset: str
    balance_agents: int
    balance_horizon_s: float
    capacity_search: bool
    mal: str = "32k"
    # applied to the offline, P/D, ablation and balance configs (e.g. a storage NIC slow
    # enough that a small batch is read-bound); ``online_overrides`` to the online runs
    overrides: tuple[str, ...] = ()
    online_overrides: tuple[str, ...] = ()
    offline_mal: str = ""  # MAL of the P/D sweep ("" = ``mal``)


# Quick: small batches on a storage NIC of 50 Gb/s per node (1/8 of the paper's), so that 64
# agents load the SNICs as a paper-size batch does at 400 Gb/s: reads bind and DualPath's
# second read path shows (docs/online.md, "Figures": measured speed-ups and wall time). The
# online sweep runs on the same NIC, its loads around the systems' storage bounds (Basic
# ≈ 0.32 APS, DualPath ≈ 0.64 APS at 32K on DS 27B 1P1D).
QUICK_SNIC = "hardware.snic_bytes_per_s=6.25e9"
QUICK = FigureSettings(
    offline=(("ds660b-2p4d", "64k", 64), ("ds27b-1p1d", "64k", 64)),
    pd_presets=("ds27b-1p1d", "ds27b-1p2d", "ds27b-2p1d"),
    pd_agents=64,
    ablation=("ds660b-2p4d", "64k", 64),
    online_preset="ds27b-1p1d",
    aps=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8),
    online=OnlineSettings(aps=1.0, horizon_s=300.0, window_s=30.0, lookback_s=90.0),
    balance_preset="ds660b-2p4d",
    balance_agents=128,
    balance_horizon_s=60.0,
    capacity_search=False,
    mal="32k",
    overrides=(QUICK_SNIC,),
    online_overrides=(QUICK_SNIC,),
    offline_mal="64k",
)
FULL = FigureSettings(
    offline=tuple(
        (p, mal, n)
        for p in ("ds27b-1p1d", "ds660b-2p4d")
        for mal in ("32k", "64k")
        for n in (512, 1024)
    ),
    pd_presets=("ds27b-1p1d", "ds27b-1p2d", "ds27b-2p1d"),
    pd_agents=1024,
    ablation=("ds660b-2p4d", "64k", 1024),
    online_preset="ds27b-1p1d",
    aps=(1.0, 2.0, 3.0, 4.0, 6.0, 8.0),
    online=OnlineSettings(aps=1.0, horizon_s=900.0),
    balance_preset="ds660b-2p4d",
    balance_agents=2048,
    balance_horizon_s=300.0,
    capacity_search=True,
)


def _steady_pass(r: OnlineResult) -> bool:
    return r.passed and r.stop_reason in ("steady_state", "all_done")


def _config(name: str, mal: str, agents: int = 64, overrides: Sequence[str] = ()) -> Config:
    return apply_overrides(
        preset(name), [f"workload.mal={mal}", f"workload.num_agents={agents}", *overrides]
    )


def _snic_gbps(config: Config) -> float:
    hw = config.hardware
    return hw.snic_bytes_per_s * hw.snic_per_node * 8 / 1e9


def describe(config: Config, agents: bool = True) -> str:
    """'ds660b-2p4d (2P4D), MAL 64k, 64 agents, SNIC 50 Gb/s': a figure's setting."""
    w = config.workload
    who = f", {w.num_agents} agents" if agents else ""
    return f"{config.name} ({config.cluster.label}), MAL {w.mal}{who}, SNIC {_snic_gbps(config):g} Gb/s"


def _online_config(s: FigureSettings) -> Config:
    return _config(s.online_preset, s.mal, 64, s.online_overrides)


def _balance_config(s: FigureSettings) -> Config:
    return _config(s.balance_preset, s.mal, s.balance_agents, s.overrides)


def _pd_mal(s: FigureSettings) -> str:
    return s.offline_mal or s.mal


def _offline_jct(
    name: str, mal: str, agents: int, system: str, overrides: Sequence[str] = ()
) -> float:
    return simulate(_config(name, mal, agents, overrides), system).jct_s


def _online_run(s: FigureSettings, system: str, aps: float) -> OnlineResult:
    return run_online(_online_config(s), system, dataclasses.replace(s.online, aps=aps))


def _balance_settings(s: FigureSettings) -> OnlineSettings:
    return dataclasses.replace(
        s.online,
        horizon_s=s.balance_horizon_s,
        stop_on_steady=False,
        slo=SLO(1e9, 1e9),  # observe only: no SLO stop
    )


def _balance_workload(s: FigureSettings) -> tuple[list[Trajectory], list[float]]:
    config = _balance_config(s)
    trajs = synthesize(config.workload, config.scheduler.block_tokens)
    return trajs, [0.0] * len(trajs)


def _balance_run(s: FigureSettings, system: str) -> OnlineResult:
    return run_online(
        _balance_config(s), system, _balance_settings(s), workload=_balance_workload(s)
    )


def _online_task(s: FigureSettings, system: str, aps: float) -> OnlineResult:
    """``_online_run`` as a task: without the live observer (the figures do not read it,
    and it holds the run's cluster)."""
    return dataclasses.replace(_online_run(s, system, aps), observer=None)


def _balance_task(s: FigureSettings, system: str) -> OnlineResult:
    return dataclasses.replace(_balance_run(s, system), observer=None)


def _capacity(s: FigureSettings, system: str) -> CapacityResult:
    return capacity(_online_config(s), system, s.online, 1.0, 4.0, 0.1, 10)


class SimFigureData:
    """``FigureData`` from simulator runs (lazy, cached). ``prefetch`` runs every
    simulation the figures need at once (in this process, or on a study pool: ``sim.fanout``,
    local processes or Ray tasks) through the shared result cache (``sim.cache``) into the
    same per-provider caches; the figures then read them (the same results)."""

    def __init__(self, settings: FigureSettings, cache: ResultCache | None = None) -> None:
        self.s = settings
        self.cache = cache if cache is not None else ResultCache(None)
        self._online: dict[tuple[str, float], OnlineResult] = {}
        self._balance: dict[str, OnlineResult] = {}
        self._jct: dict[tuple[Any, ...], float] = {}
        self._capacity: dict[str, CapacityResult] = {}

    def _offline_keys(self) -> list[tuple[Any, ...]]:
        s = self.s
        ov = tuple(s.overrides)
        keys = [
            (n, m, a, sy, ov) for n, m, a in s.offline for sy in ("basic", "dualpath", "oracle")
        ]
        keys += [
            (n, _pd_mal(s), s.pd_agents, sy, ov)
            for n in s.pd_presets
            for sy in ("basic", "dualpath")
        ]
        name, mal, agents = s.ablation
        keys += [(name, mal, agents, sy, ov) for sy, _ in ABLATION_STEPS]
        return list(dict.fromkeys(keys))

    def jobs(self) -> list[tuple[str, Job]]:
        """Every simulation of the figures: (which cache, job); a capacity bisection is one
        job per system (its probes depend on each other). Offline JCTs are full offline
        simulations (``SimResult``s, shared with `dualpath sim` through the result cache)."""
        s = self.s
        out: list[tuple[str, Job]] = []
        for n, m, a, sy, ov in self._offline_keys():
            out.append(
                ("jct", offline_job(_config(n, m, a, ov), sy, label=f"offline {n} {a}a {sy}"))
            )
        online = _online_config(s)
        for sy in ("basic", "dualpath"):
            for aps in s.aps:
                settings = dataclasses.replace(s.online, aps=aps)
                job = online_job(online, sy, settings, label=f"online {sy} {aps:g} APS")
                out.append(("online", dataclasses.replace(job, fn=_online_task, args=(s, sy, aps))))
        balance = _balance_config(s)
        for sy in ("dualpath", "dpl"):
            job = online_job(balance, sy, _balance_settings(s), None, _balance_workload(s))
            out.append(("balance", Job(job.key, _balance_task, (s, sy), f"balance {sy}")))
        if s.capacity_search:
            for sy in ("basic", "dualpath"):
                key = cache_key(online, sy, "capacity", {"settings": dataclasses.asdict(s.online)})
                out.append(("capacity", Job(key, _capacity, (s, sy), f"capacity {sy}")))
        return out

    def prefetch(
        self, workers: int = 1, ray_address: str | None = None, progress: bool = True
    ) -> None:
        """Run ``jobs()`` (cached ones read from ``self.cache``) into the provider's caches,
        one progress line per simulation (which figure it serves)."""
        jobs = self.jobs()
        results = run_jobs(
            [j for _, j in jobs], self.cache, workers, ray_address, progress, desc="figures"
        )
        offline = iter(self._offline_keys())
        online = iter((sy, aps) for sy in ("basic", "dualpath") for aps in self.s.aps)
        balance = iter(("dualpath", "dpl"))
        capacity_of = iter(("basic", "dualpath"))
        for (kind, _), result in zip(jobs, results, strict=True):
            if kind == "jct":
                self._jct[next(offline)] = result.jct_s
            elif kind == "online":
                self._online[next(online)] = result
            elif kind == "balance":
                self._balance[next(balance)] = result
            else:
                self._capacity[next(capacity_of)] = result

    def _offline(self, name: str, mal: str, agents: int, system: str) -> float:
        key = (name, mal, agents, system, tuple(self.s.overrides))
        if key not in self._jct:
            self._jct[key] = _offline_jct(name, mal, agents, system, self.s.overrides)
        return self._jct[key]

    def _run(self, system: str, aps: float) -> OnlineResult:
        key = (system, aps)
        if key not in self._online:
            self._online[key] = _online_run(self.s, system, aps)
        return self._online[key]

    def offline_jct(self) -> list[dict[str, Any]]:
        rows = []
        for name, mal, agents in self.s.offline:
            config = _config(name, mal, agents, self.s.overrides)
            for system in ("basic", "dualpath", "oracle"):
                jct = self._offline(name, mal, agents, system)
                rows.append(
                    {
                        "model": f"{config.model.name} {config.cluster.label}",
                        "mal": mal,
                        "agents": agents,
                        "system": _LABEL[system],
                        "jct_s": jct,
                        "setting": describe(config),
                    }
                )
        return rows

    def pd_sweep(self) -> list[dict[str, Any]]:
        rows = []
        s = self.s
        for name in s.pd_presets:
            config = _config(name, _pd_mal(s), s.pd_agents, s.overrides)
            for system in ("basic", "dualpath"):
                rows.append(
                    {
                        "pd": config.cluster.label,
                        "system": _LABEL[system],
                        "jct_s": self._offline(name, _pd_mal(s), s.pd_agents, system),
                    }
                )
        return rows

    def online_latency(self) -> list[dict[str, Any]]:
        rows = []
        for system in ("basic", "dualpath"):
            for aps in self.s.aps:
                r = self._run(system, aps)
                s = r.summary
                rows.append(
                    {
                        "system": _LABEL[system],
                        "aps": aps,
                        "ttft_s": s.ttft.mean,
                        "ttst_s": s.ttst.mean,
                        "tpot_s": s.tpot.mean if s.tpot.count else None,
                        "passed": r.passed,
                        "stop": r.stop_reason,
                    }
                )
        return rows

    def capacity(self) -> list[dict[str, Any]]:
        rows = []
        config = _online_config(self.s)
        for system in ("basic", "dualpath"):
            if self.s.capacity_search:
                if system not in self._capacity:
                    self._capacity[system] = _capacity(self.s, system)
                res = self._capacity[system]
                row = {
                    "capacity_aps": res.capacity_aps,
                    "method": "bisection",
                    "upper_aps": res.to_dict()["upper_aps"],
                }
            else:
                # The highest grid load that met the SLO and lies within the system's storage
                # bound (above it arrivals outpace the SNICs: no steady state exists, a short
                # run only shows a backlog growing slowly; ``studies.capacity``'s rule). A
                # run that ended at its horizon met the SLO without a verified steady state:
                # counted, and said so ("steady"). At the grid end: only a lower bound.
                bound = storage_bound(config, system).aps
                runs = {aps: self._run(system, aps) for aps in self.s.aps}
                ok = [aps for aps, r in runs.items() if r.passed and aps <= bound]
                best = max(ok, default=0.0)
                higher = [a for a in self.s.aps if a > best]
                row = {
                    "capacity_aps": best,
                    "method": "grid " + str(self.s.aps),
                    "upper_aps": min(higher) if higher else None,
                    "bound": "lower (grid end)" if not higher else "grid point",
                    "steady": bool(best) and _steady_pass(runs[best]),
                    "storage_bound_aps": bound,
                }
            rows.append({"setting": config.name, "system": _LABEL[system], **row})
        return rows

    def ttft_breakdown(self) -> list[dict[str, Any]]:
        rows = []
        for system in ("basic", "dualpath"):
            for aps in self.s.aps:
                b = mean_breakdown(self._run(system, aps).records)
                rows.append(
                    {
                        "system": _LABEL[system],
                        "aps": aps,
                        "queue_s": b.queue_s,
                        "alloc_s": b.alloc_s,
                        "read_s": b.read_s,
                        "prefill_s": b.prefill_s,
                    }
                )
        return rows

    def ablation(self) -> list[dict[str, Any]]:
        name, mal, agents = self.s.ablation
        config = _config(name, mal, agents, self.s.overrides)
        rows = ablation(config, jct_of=lambda sy: self._offline(name, mal, agents, sy))
        for row in rows:
            row["setting"] = describe(config)
        return rows

    def _balance_run(self, system: str) -> OnlineResult:
        if system not in self._balance:
            self._balance[system] = _balance_run(self.s, system)
        return self._balance[system]

    def snic_balance(self) -> dict[str, list[list[float]]]:
        window = max(5.0, self.s.balance_horizon_s / 12)
        return {
            _LABEL[s]: [[t, v] for t, v in snic_series(self._balance_run(s), window)]
            for s in ("dualpath", "dpl")
        }

    def attention_balance(self) -> dict[str, list[list[float]]]:
        return {
            _LABEL[s]: [[t, v] for t, v in attention_series(self._balance_run(s))]
            for s in ("dualpath", "dpl")
        }

    def settings_text(self) -> dict[str, str]:
        """Each figure's setting, for its title (figure name → text)."""
        s = self.s
        name, mal, agents = s.ablation
        online = _online_config(s)
        balance = _balance_config(s)
        pd = _config(s.pd_presets[0], _pd_mal(s), s.pd_agents, s.overrides)
        online_text = (
            f"{describe(online, agents=False)}, Poisson arrivals over {s.online.horizon_s:.0f} s"
        )
        balance_text = f"{describe(balance)} started together, first {s.balance_horizon_s:.0f} s"
        return {
            "offline_jct": f"offline batch, SNIC {_snic_gbps(pd):g} Gb/s per node",
            "pd_sweep": f"{pd.model.name}, MAL {pd.workload.mal}, {s.pd_agents} agents, "
            f"SNIC {_snic_gbps(pd):g} Gb/s",
            "online_latency": online_text,
            "ttft_breakdown": online_text,
            "ablation": describe(_config(name, mal, agents, s.overrides)),
            "snic_balance": balance_text,
            "attention_balance": balance_text,
        }

    def meta(self) -> dict[str, Any]:
        s = self.s
        online, balance = _online_config(s), _balance_config(s)
        name, mal, agents = s.ablation
        return {
            "title": "DualPath simulator figures" + (" (quick settings)" if s is QUICK else ""),
            "slo_ttft_s": s.online.slo.ttft_s,
            "slo_tpot_s": s.online.slo.tpot_s,
            "settings": self.settings_text(),
            "notes": (
                f"Online: {s.online_preset}, MAL {s.mal}, SNIC {_snic_gbps(online):g} Gb/s, "
                f"Poisson arrivals over {s.online.horizon_s:.0f} s, stop-rule window "
                f"{s.online.window_s:.0f} s / lookback {s.online.lookback_s:.0f} s, SLO on the "
                f"mean. Load balance: {describe(balance)} started together (offline batch), "
                f"first {s.balance_horizon_s:.0f} s, "
                "DualPath vs DPL (round-robin PE/DE and read-side choice, same layerwise "
                "prefill and transfers). Ablation and offline JCT: offline batch runs"
                + (f" with {', '.join(s.overrides)}" if s.overrides else "")
                + "."
            ),
            "run": {
                "seed": online.workload.seed,
                "code_version": code_version(),
                "overrides": list(s.overrides),
                "online_overrides": list(s.online_overrides),
                "configs": {
                    "online": run_meta(online)["config"],
                    "balance": run_meta(balance)["config"],
                    "ablation": run_meta(_config(name, mal, agents, s.overrides))["config"],
                },
            },
        }


def make_figure_data(
    quick: bool,
    workers: int = 1,
    ray_address: str | None = None,
    progress: bool = False,
    cache: ResultCache | None = None,
    prefetch: bool = True,
) -> SimFigureData:
    """The provider `dualpath figures` uses without ``--from``: every simulation run up front
    (``prefetch``: in this process for one worker, else on the study pool), through
    ``cache``, with a progress line per simulation (``prefetch=False``: lazily, on first use
    of each figure)."""
    data = SimFigureData(QUICK if quick else FULL, cache)
    if prefetch:
        data.prefetch(workers, ray_address, progress)
    return data
