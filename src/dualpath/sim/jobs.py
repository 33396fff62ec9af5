"""Run a list of simulations through the shared result cache, in process or on a study pool.

A ``Job`` is a cache key, a module-level task (picklable, so a worker process or a Ray task
can run it) and its arguments. ``run_jobs`` looks every key up first, runs the misses (one
by one in this process for ``workers=1``, else on ``fanout.study_pool``), writes each result
to the cache as it arrives (from this process: a remote Ray node needs no shared folder)
and returns the results in job order. Nothing here decides anything about a simulation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Any

from dualpath import progress
from dualpath.config import Config
from dualpath.config.sim import SimConfig
from dualpath.sim.cache import ResultCache, cache_key
from dualpath.sim.fanout import study_pool
from dualpath.sim.online import OnlineResult, OnlineSettings, run_online
from dualpath.sim.results import SimResult
from dualpath.sim.runner import simulate
from dualpath.workload import Trajectory


@dataclass(frozen=True, slots=True)
class Job:
    key: str  # ResultCache key ("" = never cached)
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    label: str = ""


def offline_task(
    config: Config,
    system: str,
    sim: SimConfig | None = None,
    trajectories: Sequence[Trajectory] | None = None,
) -> SimResult:
    """One offline simulation (``runner.simulate``), as a task."""
    return simulate(config, system, sim, trajectories)


def online_task(
    config: Config,
    system: str,
    settings: OnlineSettings,
    sim: SimConfig | None = None,
    workload: tuple[Sequence[Trajectory], Sequence[float]] | None = None,
) -> OnlineResult:
    """One online run without its live observer (it holds the whole cluster)."""
    result = run_online(config, system, settings, sim, workload=workload)
    return dataclasses.replace(result, observer=None)


def _workload_digest(trajectories: Sequence[Trajectory] | None) -> str:
    if trajectories is None:
        return ""
    h = hashlib.sha256()
    for t in trajectories:
        h.update(repr((t.agent_id, [(x.append_tokens, x.gen_tokens) for x in t.turns])).encode())
    return h.hexdigest()


def _with_sim(config: Config, sim: SimConfig | None) -> Config:
    return config if sim is None else dataclasses.replace(config, sim=sim)


def offline_job(
    config: Config,
    system: str,
    sim: SimConfig | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    label: str = "",
) -> Job:
    """The job of one offline simulation (its key covers ``sim`` and the trajectories)."""
    keyed = _with_sim(config, sim)
    extra = {"trajectories": _workload_digest(trajectories)}
    key = cache_key(keyed, system, "offline", extra)
    return Job(key, offline_task, (config, system, sim, trajectories), label or system)


def online_job(
    config: Config,
    system: str,
    settings: OnlineSettings,
    sim: SimConfig | None = None,
    workload: tuple[Sequence[Trajectory], Sequence[float]] | None = None,
    label: str = "",
) -> Job:
    """The job of one online run (its key covers the settings and an explicit workload)."""
    keyed = _with_sim(config, sim)
    extra: dict[str, Any] = {"settings": dataclasses.asdict(settings)}
    if workload is not None:
        extra["trajectories"] = _workload_digest(workload[0])
        extra["arrivals_s"] = [repr(a) for a in workload[1]]
    key = cache_key(keyed, system, "online", extra)
    return Job(key, online_task, (config, system, settings, sim, workload), label or system)


def run_jobs(
    jobs: Sequence[Job],
    cache: ResultCache | None = None,
    workers: int = 1,
    ray_address: str | None = None,
    show_progress: bool = True,
    desc: str = "sim",
) -> list[Any]:
    """Every job's result in job order; cached ones are read, the rest run and are cached.
    Jobs with the same key run once. Progress: one tick per simulation run now."""
    if workers < 1:
        raise ValueError(f"--workers={workers} is invalid: must be >= 1")
    cache = cache if cache is not None else ResultCache(None)
    results: dict[str, Any] = {}
    todo: dict[str, Job] = {}
    for i, job in enumerate(jobs):
        k = job.key or f"#{i}"
        if k in results or k in todo:
            continue
        hit = cache.get(job.key) if job.key else None
        if hit is not None:
            results[k] = hit
        else:
            todo[k] = job
    if todo:
        with progress.bar(len(todo), desc, "sim", disable=not show_progress) as bar:

            def done(k: str, value: Any) -> None:
                results[k] = value
                if todo[k].key:
                    cache.put(todo[k].key, value)
                bar.set_postfix_str(todo[k].label)
                bar.update(1)

            if workers == 1 and ray_address is None:
                for k, job in todo.items():
                    done(k, job.fn(*job.args))
            else:
                with study_pool(workers, ray_address) as pool:
                    futures = {pool.submit(job.fn, *job.args): k for k, job in todo.items()}
                    for fut in as_completed(futures):
                        done(futures[fut], fut.result())
    return [results[job.key or f"#{i}"] for i, job in enumerate(jobs)]
