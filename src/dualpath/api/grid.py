"""``dualpath.sweep``: a grid over any configuration keys (several keys: their product), each
point × system one cached simulation, run in process or on a study pool; ``Sweep`` holds
the points and their results and turns them into a table, JSON and the CLI's files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.api.frames import frame, metric_row
from dualpath.api.simulation import (
    CacheArg,
    Simulation,
    as_cache,
    as_config,
    as_systems,
    write_csv,
)
from dualpath.config import Config, apply_overrides, config_for, preset
from dualpath.config.systems import system_spec
from dualpath.sim.cache import code_version, run_meta
from dualpath.sim.jobs import offline_job, run_jobs

if TYPE_CHECKING:
    import pandas as pd

# keys whose value is itself a comma-separated list: never split into grid values
LIST_VALUED_KEYS = ("sim.systems",)


@dataclass(frozen=True, slots=True)
class Choice:
    """One value of an axis: its label and the overrides that set it (``preset=NAME``
    first, when it changes the preset, replaces the config by that preset)."""

    label: str
    overrides: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Axis:
    """One dimension of the grid: a name (the key, e.g. ``hardware.snic_bytes_per_s``) and
    its choices, in the order given. A ``hidden`` axis (overrides every point shares, placed
    where their order matters) is in no label and no table column."""

    name: str
    choices: tuple[Choice, ...]
    hidden: bool = False

    @classmethod
    def of(cls, key: str, values: Sequence[Any]) -> Axis:
        """``key`` set to each of ``values`` (``section.key``, ``model``, ``hardware`` or
        ``preset``)."""
        if not values:
            raise ValueError(f"sweep axis {key!r} has no values")
        texts = [_text(v) for v in values]
        if len(set(texts)) != len(texts):
            raise ValueError(f"sweep axis {key!r} repeats a value: {', '.join(texts)}")
        short = key.rsplit(".", 1)[-1]
        return cls(key, tuple(Choice(f"{short}={t}", (f"{key}={t}",)) for t in texts))


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        short = f"{value:.12g}"
        return short if float(short) == value else repr(value)
    return str(value).strip()


def axis_value(config: Config, axis: str, label: str) -> Any:
    """The value an axis set, read back typed from the resolved config where it names a
    field (``hardware.snic_bytes_per_s`` → float; ``model`` → the model's name); else the
    text of its label."""
    section, _, key = axis.partition(".")
    part = getattr(config, section, None) if section != "name" else None
    if key and part is not None and hasattr(part, key):
        return getattr(part, key)
    if not key and section in ("model", "hardware") and part is not None:
        return part.name
    if axis == "preset":
        return config.name
    return label.split("=", 1)[1] if "=" in label else label


def parse_set(text: str) -> tuple[str, list[str]]:
    """``section.key=v1,v2`` → (key, [v1, v2]) (one value unless the key is list-valued)."""
    if "=" not in text:
        raise ValueError(f"--set {text!r} is invalid: must look like section.key=value[,value…]")
    key, value = (part.strip() for part in text.split("=", 1))
    if key in LIST_VALUED_KEYS:
        return key, [value]
    values = [v.strip() for v in value.split(",")]
    if any(not v for v in values):
        raise ValueError(f"--set {text!r} is invalid: an empty value in the list")
    return key, values


def apply_point(base: Config, overrides: Sequence[str]) -> Config:
    """``overrides`` applied in order; ``preset=NAME`` restarts from that preset."""
    config = base
    for text in overrides:
        key, _, value = text.partition("=")
        if key.strip() == "preset":
            config = preset(value.strip())
        else:
            config = apply_overrides(config, [text])
    return config


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One grid point: its label, each axis's value label, the resolved config, results."""

    label: str
    values: Mapping[str, str]
    simulation: Simulation

    @property
    def config(self) -> Config:
        return self.simulation.config


@dataclass(frozen=True, slots=True)
class Sweep:
    """Every grid point's ``Simulation``, in grid order (the first axis varies slowest)."""

    base: Config
    axes: tuple[Axis, ...]
    points: tuple[SweepPoint, ...]
    from_cache: int = 0
    simulated: int = 0

    @property
    def systems(self) -> list[str]:
        return self.points[0].simulation.systems if self.points else []

    def rows(self) -> list[dict[str, Any]]:
        """One row per (point, system): ``point``, each axis's value (as set), ``system``, then
        every metric (``frames.metric_row``)."""
        out = []
        for p in self.points:
            comp = p.simulation.comparisons()
            for name, r in p.simulation.results.items():
                axis_values = {
                    a.name: axis_value(p.config, a.name, p.values[a.name])
                    for a in self.axes
                    if not a.hidden
                }
                out.append({"point": p.label, **axis_values, **metric_row(r, comp[name])})
        return out

    def frame(self) -> pd.DataFrame:
        """``rows()`` as a DataFrame (needs pandas): pivot it with ``frame.pivot(...)``."""
        return frame(self.rows())

    def to_json(self) -> dict[str, Any]:
        """sweep.json: the grid, each point's resolved config and per-system results, the
        base config, seed and code version."""
        return {
            "run": run_meta(self.base),
            "axes": {a.name: [c.label for c in a.choices] for a in self.axes if not a.hidden},
            "rows": self.rows(),
            "points": [
                {
                    "label": p.label,
                    "values": dict(p.values),
                    "seed": p.config.workload.seed,
                    "config": run_meta(p.config)["config"],
                    "results": p.simulation.to_json()["results"],
                }
                for p in self.points
            ],
            "code_version": code_version(),
        }

    def write(self, out: str | Path, title: str = "") -> list[Path]:
        """sweep.json, sweep.csv (every metric per point and system) and sweep.png (its x
        axis labelled with the axes its tick labels join)."""
        from dualpath.sim.plots import plot_sweep

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        files = [folder / n for n in ("sweep.json", "sweep.csv", "sweep.png")]
        files[0].write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        write_csv(files[1], self.rows())
        # tick labels name the axes that vary; those with one value go to the title
        shown = [a for a in self.axes if not a.hidden]
        varying = [a for a in shown if len(a.choices) > 1] or shown
        fixed = [a.choices[0].label for a in shown if a not in varying]
        labels = ["/".join(p.values[a.name] for a in varying) for p in self.points]
        jct = {
            (label, s): r.jct_s
            for label, p in zip(labels, self.points, strict=True)
            for s, r in p.simulation.results.items()
        }
        names = " / ".join(a.name for a in varying) or "point"
        head = title or "Offline JCT"
        if fixed:
            head += " (" + ", ".join(fixed) + ")"
        plot_sweep(labels, self.systems, jct, files[2], head, f"grid point: {names}")
        return files


def expand(axes: Sequence[Axis]) -> list[tuple[str, dict[str, str], tuple[str, ...]]]:
    """(label, {axis: choice label}, overrides) for every grid point, first axis slowest."""
    out = []
    for combo in itertools.product(*(a.choices for a in axes)):
        shown = [(a, c) for a, c in zip(axes, combo, strict=True) if not a.hidden]
        label = "/".join(c.label for _, c in shown)
        values = {a.name: c.label for a, c in shown}
        overrides = tuple(o for c in combo for o in c.overrides)
        out.append((label, values, overrides))
    return out


def sweep(
    config: Config | str,
    grid: Mapping[str, Sequence[Any]] | Sequence[Axis],
    systems: str | Sequence[str] | None = None,
    *,
    overrides: Sequence[str] = (),
    cache: CacheArg = None,
    workers: int = 1,
    ray_address: str | None = None,
    progress: bool = False,
) -> Sweep:
    """Simulate ``systems`` at every point of ``grid`` ({key: values}, the product over keys
    in the order given, e.g. ``{"hardware.snic_bytes_per_s": [12.5e9, 25e9],
    "cluster.num_decode_nodes": [2, 4]}``; or ``Axis`` objects) on ``config`` (a Config or a
    preset name, then ``overrides``). Every point is validated before anything runs.
    ``cache``, ``workers``, ``ray_address`` as for ``simulate``."""
    base = as_config(config, overrides)
    axes = (
        tuple(grid)
        if not isinstance(grid, Mapping)
        else tuple(Axis.of(k, v) for k, v in grid.items())
    )
    if not axes:
        raise ValueError("sweep: the grid has no axis")
    seen: set[str] = set()
    for a in axes:
        if a.name in seen:
            raise ValueError(f"sweep: the axis {a.name} appears twice (give its values once)")
        seen.add(a.name)
    grid_points = expand(axes)
    configs = [apply_point(base, ov) for _, _, ov in grid_points]  # ValueError before any run
    system_lists = [as_systems(systems, c) for c in configs]
    for c, names_ in zip(configs, system_lists, strict=True):
        for name in names_:
            config_for(c, system_spec(name))
    jobs = [
        offline_job(c, s, label=f"{label} {s}")
        for (label, _, _), c, names_ in zip(grid_points, configs, system_lists, strict=True)
        for s in names_
    ]
    store = as_cache(cache)
    hits, misses = store.hits, store.misses
    results = iter(run_jobs(jobs, store, workers, ray_address, progress, desc="sweep"))
    points = []
    for (label, values, _), c, names_ in zip(grid_points, configs, system_lists, strict=True):
        sim = Simulation(c, {s: next(results) for s in names_}, label=label)
        points.append(SweepPoint(label, values, sim))
    return Sweep(base, axes, tuple(points), store.hits - hits, store.misses - misses)
