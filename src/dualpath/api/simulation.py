"""``dualpath.simulate``: several systems on one configuration, through the result cache;
``Simulation`` holds their results and turns them into tables, JSON and the CLI's files."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.api.frames import frame, metric_row, turn_row
from dualpath.config import Config, config_for, preset
from dualpath.config.sim import SimConfig, parse_systems
from dualpath.config.systems import system_spec
from dualpath.sim.cache import ResultCache, run_meta
from dualpath.sim.jobs import offline_job, run_jobs
from dualpath.sim.report import comparisons, order_systems, results_json
from dualpath.sim.results import SimResult
from dualpath.workload import Trajectory

if TYPE_CHECKING:
    import pandas as pd

CacheArg = ResultCache | str | Path | bool | None


def as_config(config: Config | str, overrides: Sequence[str] = ()) -> Config:
    """A Config, or a preset name; then ``overrides`` (``section.key=value``) in order."""
    base = preset(config) if isinstance(config, str) else config
    if not isinstance(base, Config):
        raise ValueError(f"config={config!r} is invalid: give a Config or a preset name")
    return base.with_overrides(*overrides) if overrides else base


def as_systems(systems: str | Sequence[str] | None, config: Config) -> list[str]:
    """'basic,dualpath' or a list → the systems in design §11 order (default: ``sim.systems``)."""
    if systems is None:
        return order_systems(config.sim.system_list)
    text = systems if isinstance(systems, str) else ",".join(systems)
    return order_systems(parse_systems(text))


def as_cache(cache: CacheArg) -> ResultCache:
    """True: the default folder (``$DUALPATH_CACHE`` or runs/cache); False/None: off; a
    folder; or a ``ResultCache``."""
    if isinstance(cache, ResultCache):
        return cache
    if cache is True:
        return ResultCache.resolve()
    if cache is None or cache is False:
        return ResultCache(None)
    return ResultCache.resolve(cache)


@dataclass(frozen=True, slots=True)
class Simulation:
    """The results of several systems on one configuration (same workload, seed, model).

    ``results`` maps system name → ``SimResult`` in design §11 order; ``from_cache`` counts the
    systems read from the result cache rather than simulated."""

    config: Config
    results: Mapping[str, SimResult]
    from_cache: int = 0
    label: str = field(default="", compare=False)

    def __getitem__(self, system: str) -> SimResult:
        return self.results[system]

    @property
    def systems(self) -> list[str]:
        return list(self.results)

    def jct_s(self, system: str) -> float:
        return self.results[system].jct_s

    def speedup(self, system: str, over: str = "basic") -> float:
        """JCT(over) / JCT(system): > 1 when ``system`` finishes first."""
        return self.results[over].jct_s / self.results[system].jct_s

    def comparisons(self) -> dict[str, dict[str, float | None]]:
        """Per system: speed-up over Basic and fraction of Oracle (None when absent)."""
        return comparisons(self.results)

    def rows(self) -> list[dict[str, Any]]:
        """One row per system with every metric (``frames.metric_row``)."""
        comp = self.comparisons()
        return [metric_row(r, comp[name]) for name, r in self.results.items()]

    def frame(self) -> pd.DataFrame:
        """One row per system, every metric a column (needs pandas)."""
        return frame(self.rows())

    def turn_rows(self, system: str | None = None) -> list[dict[str, Any]]:
        names = [system] if system is not None else self.systems
        return [{"system": n, **turn_row(rec)} for n in names for rec in self.results[n].records]

    def turns_frame(self, system: str | None = None) -> pd.DataFrame:
        """One row per turn (of ``system``, or of every system with a ``system`` column):
        its timeline, tokens, read side and latencies (needs pandas)."""
        return frame(self.turn_rows(system))

    def to_json(self) -> dict[str, Any]:
        """The ``results.json`` payload of ``dualpath sim``, with the resolved config, seed and
        code version under ``run``."""
        return results_json(self.results, {"run": run_meta(self.config)})

    def write(self, out: str | Path, title: str | None = None) -> list[Path]:
        """The files ``dualpath sim`` writes: config.json, results.json, results.csv (every
        metric, one row per system) and jct.png. Returns their paths."""
        from dualpath.sim.plots import plot_results

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        files = [folder / n for n in ("config.json", "results.json", "results.csv", "jct.png")]
        resolved = {
            "config": dataclasses.asdict(self.config),
            "sim": dataclasses.asdict(self.config.sim),
            **{k: v for k, v in run_meta(self.config).items() if k != "config"},
        }
        files[0].write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
        files[1].write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        write_csv(files[2], self.rows())
        plot_results(self.results, files[3], title or setting_title(self.config))
        return files


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rows to CSV; columns in first-seen order, lists as JSON text, None as empty."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in r.items()}
            )


def setting_title(config: Config) -> str:
    """'ds27b-1p1d (1P1D, ds27b), 64 agents, MAL 64k, SNIC 100 Gb/s': what a figure shows."""
    w, hw = config.workload, config.hardware
    snic = hw.snic_bytes_per_s * hw.snic_per_node * 8 / 1e9
    return (
        f"{config.name} ({config.cluster.label}, {config.model.name}), {w.num_agents} agents, "
        f"MAL {w.mal}, SNIC {snic:g} Gb/s per node"
    )


def simulate(
    config: Config | str,
    systems: str | Sequence[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    sim: SimConfig | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    cache: CacheArg = None,
    workers: int = 1,
    ray_address: str | None = None,
    progress: bool = False,
) -> Simulation:
    """Simulate ``systems`` (default: ``config.sim.systems``) offline on ``config`` (a
    ``Config`` or a preset name, then ``overrides``). ``sim`` replaces ``config.sim``;
    ``trajectories`` replaces the synthesised workload. ``cache``: a folder, True (the
    default folder), or None/False (off). ``workers`` > 1 or ``ray_address`` run the
    systems in parallel (``sim.fanout``). Same config, seed and code ⇒ the same results."""
    resolved = as_config(config, overrides)
    if sim is not None:
        resolved = dataclasses.replace(resolved, sim=sim)
    names = as_systems(systems, resolved)
    for name in names:  # a scheduler.policy no system may run: fail before any simulation
        config_for(resolved, system_spec(name))
    store = as_cache(cache)
    hits = store.hits
    jobs = [offline_job(resolved, name, None, trajectories) for name in names]
    results = run_jobs(jobs, store, workers, ray_address, progress, desc=resolved.name)
    return Simulation(resolved, dict(zip(names, results, strict=True)), store.hits - hits)
