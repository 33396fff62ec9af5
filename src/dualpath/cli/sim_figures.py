"""The simulator-backed ``FigureData`` provider of `dualpath figures` (docs/online.md).

``make_figure_data(quick)`` returns a provider whose methods run the simulator on first
call (results cached per provider). ``quick`` = small settings that finish in about 1–2
minutes on 2 cores (what tests and a fresh clone use); full = paper-like settings (long).
Every number comes from a seeded simulation; nothing is tuned to the paper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Any

from dualpath.config import Config, apply_overrides, preset
from dualpath.metrics.breakdown import mean_breakdown
from dualpath.metrics.capacity import CapacityResult
from dualpath.metrics.slo import SLO
from dualpath.sim.fanout import study_pool
from dualpath.sim.online import OnlineResult, OnlineSettings, run_online
from dualpath.sim.runner import simulate
from dualpath.sim.studies import (
    ABLATION_STEPS,
    ablation,
    attention_series,
    capacity,
    snic_series,
)
from dualpath.workload import synthesize

_LABEL = {"basic": "Basic", "dualpath": "DualPath", "oracle": "Oracle", "dpl": "DPL (RR)"}


@dataclass(frozen=True, slots=True)
class FigureSettings:
    """What each figure simulates. ``online_preset`` at each of ``aps`` for latency and the
    breakdown; ``balance_preset`` with ``balance_agents`` agents started together (a
    storage-bound offline batch, observed for ``balance_horizon_s``; DualPath vs DPL =
    round-robin engine and read-side choice) for the load-balance series; ``capacity_search`` runs bisection
    per system, else capacity = the highest passing APS of the latency sweep."""

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


QUICK = FigureSettings(
    offline=(("ds27b-1p1d", "32k", 64), ("ds27b-1p1d", "32k", 128)),
    pd_presets=("ds27b-1p1d", "ds27b-1p2d", "ds27b-2p1d"),
    pd_agents=96,
    ablation=("ds27b-1p1d", "32k", 128),
    online_preset="ds27b-1p1d",
    aps=(1.0, 2.0, 3.0, 4.0, 5.0),
    online=OnlineSettings(aps=1.0, horizon_s=150.0, window_s=20.0, lookback_s=60.0),
    balance_preset="ds660b-2p4d",
    balance_agents=512,
    balance_horizon_s=60.0,
    capacity_search=False,
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


def _config(name: str, mal: str, agents: int = 64) -> Config:
    return apply_overrides(preset(name), [f"workload.mal={mal}", f"workload.num_agents={agents}"])


def _offline_jct(name: str, mal: str, agents: int, system: str) -> float:
    return simulate(_config(name, mal, agents), system).jct_s


def _online_run(s: FigureSettings, system: str, aps: float) -> OnlineResult:
    config = _config(s.online_preset, s.mal)
    return run_online(config, system, dataclasses.replace(s.online, aps=aps))


def _balance_run(s: FigureSettings, system: str) -> OnlineResult:
    config = _config(s.balance_preset, s.mal, s.balance_agents)
    trajs = synthesize(config.workload, config.scheduler.block_tokens)
    settings = dataclasses.replace(
        s.online,
        horizon_s=s.balance_horizon_s,
        stop_on_steady=False,
        slo=SLO(1e9, 1e9),  # observe only: no SLO stop
    )
    batch = (trajs, [0.0] * len(trajs))
    return run_online(config, system, settings, workload=batch)


def _online_task(s: FigureSettings, system: str, aps: float) -> OnlineResult:
    """``_online_run`` as a task: without the live observer (the figures do not read it,
    and it holds the run's cluster)."""
    return dataclasses.replace(_online_run(s, system, aps), observer=None)


def _balance_task(s: FigureSettings, system: str) -> OnlineResult:
    return dataclasses.replace(_balance_run(s, system), observer=None)


def _capacity(s: FigureSettings, system: str) -> CapacityResult:
    config = _config(s.online_preset, s.mal)
    return capacity(config, system, s.online, 1.0, 4.0, 0.1, 10)


class SimFigureData:
    """``FigureData`` from simulator runs (lazy, cached). ``prefetch`` runs every
    simulation the figures need at once on a study pool (``sim.fanout``: local processes or
    Ray tasks) into the same caches; the figures then read them (the same results)."""

    def __init__(self, settings: FigureSettings) -> None:
        self.s = settings
        self._online: dict[tuple[str, float], OnlineResult] = {}
        self._balance: dict[str, OnlineResult] = {}
        self._jct: dict[tuple[str, str, int, str], float] = {}
        self._capacity: dict[str, CapacityResult] = {}

    def jobs(self) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
        """Every simulation of the figures: (cache, task, arguments); capacity bisection
        is one task per system (its probes depend on each other)."""
        s = self.s
        out: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = []
        offline = [(n, m, a, sy) for n, m, a in s.offline for sy in ("basic", "dualpath", "oracle")]
        offline += [
            (n, s.mal, s.pd_agents, sy) for n in s.pd_presets for sy in ("basic", "dualpath")
        ]
        name, mal, agents = s.ablation
        offline += [(name, mal, agents, sy) for sy, _ in ABLATION_STEPS]
        out += [("jct", _offline_jct, key) for key in dict.fromkeys(offline)]
        out += [
            ("online", _online_task, (s, sy, aps)) for sy in ("basic", "dualpath") for aps in s.aps
        ]
        out += [("balance", _balance_task, (s, sy)) for sy in ("dualpath", "dpl")]
        if s.capacity_search:
            out += [("capacity", _capacity, (s, sy)) for sy in ("basic", "dualpath")]
        return out

    def prefetch(self, workers: int, ray_address: str | None, progress: bool = True) -> None:
        """Run ``jobs()`` on a study pool into the caches (a progress bar per simulation)."""
        from tqdm import tqdm

        with study_pool(workers, ray_address) as pool:
            futures = {pool.submit(fn, *args): (kind, args) for kind, fn, args in self.jobs()}
            for fut in tqdm(
                as_completed(futures), total=len(futures), unit="sim", disable=not progress
            ):
                kind, args = futures[fut]
                result = fut.result()
                if kind == "jct":
                    self._jct[args] = result
                elif kind == "online":
                    self._online[(args[1], args[2])] = result
                elif kind == "balance":
                    self._balance[args[1]] = result
                else:
                    self._capacity[args[1]] = result

    def _offline(self, name: str, mal: str, agents: int, system: str) -> float:
        key = (name, mal, agents, system)
        if key not in self._jct:
            self._jct[key] = _offline_jct(*key)
        return self._jct[key]

    def _run(self, system: str, aps: float) -> OnlineResult:
        key = (system, aps)
        if key not in self._online:
            self._online[key] = _online_run(self.s, system, aps)
        return self._online[key]

    def offline_jct(self) -> list[dict[str, Any]]:
        rows = []
        for name, mal, agents in self.s.offline:
            config = _config(name, mal, agents)
            for system in ("basic", "dualpath", "oracle"):
                jct = self._offline(name, mal, agents, system)
                rows.append(
                    {
                        "model": config.model.name,
                        "mal": mal,
                        "agents": agents,
                        "system": _LABEL[system],
                        "jct_s": jct,
                    }
                )
        return rows

    def pd_sweep(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.s.pd_presets:
            config = _config(name, self.s.mal, self.s.pd_agents)
            for system in ("basic", "dualpath"):
                rows.append(
                    {
                        "pd": config.cluster.label,
                        "system": _LABEL[system],
                        "jct_s": self._offline(name, self.s.mal, self.s.pd_agents, system),
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
        config = _config(self.s.online_preset, self.s.mal)
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
                # Short horizon: a run that merely reached it may still be diverging, so
                # only a verified steady state within the SLO counts as a pass here.
                ok = [aps for aps in self.s.aps if _steady_pass(self._run(system, aps))]
                best = max(ok, default=0.0)
                row = {
                    "capacity_aps": best,
                    "method": "grid " + str(self.s.aps) + ", steady-state passes only",
                    "bound": "lower (grid end)" if best == max(self.s.aps) else "grid point",
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
        rows = ablation(
            _config(name, mal, agents), jct_of=lambda sy: self._offline(name, mal, agents, sy)
        )
        for row in rows:
            row["setting"] = f"{name} {mal} {agents} agents"
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

    def meta(self) -> dict[str, Any]:
        s = self.s
        return {
            "title": "DualPath simulator figures" + (" (quick settings)" if s is QUICK else ""),
            "slo_ttft_s": s.online.slo.ttft_s,
            "slo_tpot_s": s.online.slo.tpot_s,
            "notes": (
                f"Online: {s.online_preset}, MAL {s.mal}, Poisson arrivals over "
                f"{s.online.horizon_s:.0f} s, stop-rule window {s.online.window_s:.0f} s / "
                f"lookback {s.online.lookback_s:.0f} s, SLO on the mean. Load balance: "
                f"{s.balance_preset}, {s.balance_agents} agents started together (offline batch), "
                f"first {s.balance_horizon_s:.0f} s, "
                "DualPath vs DPL (round-robin PE/DE and read-side choice, same layerwise "
                "prefill and transfers). Ablation and offline JCT: offline batch runs."
            ),
        }


def make_figure_data(
    quick: bool, workers: int = 1, ray_address: str | None = None, progress: bool = False
) -> SimFigureData:
    """The provider `dualpath figures` uses without ``--from``; with ``workers`` > 1 or a
    ``ray_address``, its simulations run at once on that study pool (``prefetch``)."""
    data = SimFigureData(QUICK if quick else FULL)
    if workers > 1 or ray_address is not None:
        data.prefetch(workers, ray_address, progress)
    return data
