"""Workloads of one's own: trajectories from a JSONL file, or drawn from distributions given
in a TOML table (turn count, first-turn length, append, generation).

Every mistake in a file is one ``ValueError`` naming the file, the line or key and what is
allowed. Draws only from the injected ``random.Random`` (the workload's seed).

JSONL: one trajectory per line, ``{"turns": [[append, gen], ...]}`` or ``{"turns":
[{"append_tokens": a, "gen_tokens": g}, ...]}`` (other keys ignored; blank lines skipped).

TOML (``workload.distributions``): four tables, each a distribution of positive numbers::

    [turns]          # turns per trajectory (rounded, at least 1)
    dist = "lognormal"   # lognormal (mean, sigma) | uniform (low, high) | constant (value)
    mean = 60
    sigma = 0.5
    [first_append]   # tokens of the first turn's prompt (system prompt + task)
    dist = "lognormal"
    mean = 6000
    sigma = 0.35
    [append]         # tokens appended per later turn (tool output)
    dist = "lognormal"
    mean = 600
    sigma = 1.0
    [generation]     # tokens generated per turn (the next tool call)
    dist = "constant"
    value = 150

A trajectory stops before the turn that would take its context past the MAL cap (as the
synthesiser's do).
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.workload.trajectory import TrajectoryTurn

DISTRIBUTION_TABLES = ("turns", "first_append", "append", "generation")
_PARAMS = {"lognormal": ("mean", "sigma"), "uniform": ("low", "high"), "constant": ("value",)}


@dataclass(frozen=True, slots=True)
class Distribution:
    """One positive quantity: ``kind`` in lognormal / uniform / constant, its parameters."""

    kind: str
    a: float  # mean, low or value
    b: float = 0.0  # sigma or high

    def draw(self, rng: random.Random) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        mu = math.log(self.a) - self.b * self.b / 2  # arithmetic mean a
        return math.exp(rng.gauss(mu, self.b))


def _distribution(source: str, name: str, table: Any) -> Distribution:
    where = f"{source}: [{name}]"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table (dist = ..., and its parameters)")
    kind = table.get("dist", "lognormal")
    if kind not in _PARAMS:
        raise ValueError(f"{where} dist={kind!r} is invalid: must be one of {', '.join(_PARAMS)}")
    params = _PARAMS[kind]
    unknown = sorted(set(table) - {"dist", *params})
    if unknown:
        raise ValueError(
            f"{where} has unknown key {unknown[0]!r} (a {kind} takes {', '.join(params)})"
        )
    values = []
    for p in params:
        if p not in table:
            raise ValueError(f"{where} lacks {p} (a {kind} takes {', '.join(params)})")
        v = table[p]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{where} {p}={v!r} is invalid: must be a finite number")
        values.append(float(v))
    if kind == "uniform" and not 0 < values[0] <= values[1]:
        raise ValueError(f"{where} low={values[0]:g}, high={values[1]:g}: need 0 < low <= high")
    if kind == "lognormal" and not (values[0] > 0 and values[1] >= 0):
        raise ValueError(
            f"{where} mean={values[0]:g}, sigma={values[1]:g}: need mean > 0, sigma >= 0"
        )
    if kind == "constant" and values[0] <= 0:
        raise ValueError(f"{where} value={values[0]:g} is invalid: must be > 0")
    return Distribution(kind, *values)


@dataclass(frozen=True, slots=True)
class Distributions:
    """The four distributions of a custom synthetic workload (module docstring)."""

    turns: Distribution
    first_append: Distribution
    append: Distribution
    generation: Distribution

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "distributions") -> Distributions:
        unknown = sorted(set(data) - set(DISTRIBUTION_TABLES))
        if unknown:
            raise ValueError(
                f"{source}: unknown table [{unknown[0]}] (known: {', '.join(DISTRIBUTION_TABLES)})"
            )
        missing = [t for t in DISTRIBUTION_TABLES if t not in data]
        if missing:
            raise ValueError(f"{source}: lacks the table [{missing[0]}]")
        return cls(*(_distribution(source, t, data[t]) for t in DISTRIBUTION_TABLES))

    def draw_turns(self, rng: random.Random, cap_tokens: int) -> tuple[TrajectoryTurn, ...]:
        """One trajectory: a turn count, then its turns, stopped before the MAL cap."""
        planned = max(1, round(self.turns.draw(rng)))
        first = min(max(1, round(self.first_append.draw(rng))), max(1, cap_tokens // 2))
        gen = min(max(1, round(self.generation.draw(rng))), max(1, cap_tokens - first))
        turns = [TrajectoryTurn(first, gen)]
        context = first + gen
        while len(turns) < planned:
            append = max(1, round(self.append.draw(rng)))
            gen = max(1, round(self.generation.draw(rng)))
            if context + append + gen > cap_tokens:
                break
            turns.append(TrajectoryTurn(append, gen))
            context += append + gen
        return tuple(turns)


def load_distributions(path: str | Path) -> Distributions:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(
            f"workload.distributions={str(p)!r} cannot be read: {exc.strerror}"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{p}: is not valid TOML: {exc}") from None
    return Distributions.from_mapping(data, str(p))


def _turn(where: str, item: Any) -> TrajectoryTurn:
    if isinstance(item, Mapping):
        pair = (item.get("append_tokens"), item.get("gen_tokens"))
    elif isinstance(item, list | tuple) and len(item) == 2:
        pair = (item[0], item[1])
    else:
        raise ValueError(
            f'{where}: a turn must be [append, gen] or {{"append_tokens": a, "gen_tokens": g}}'
            f", got {item!r}"
        )
    for name, v in zip(("append_tokens", "gen_tokens"), pair, strict=True):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {name}={v!r} is invalid: must be an integer >= 1")
    return TrajectoryTurn(int(pair[0]), int(pair[1]))  # type: ignore[arg-type]


def load_trajectories(path: str | Path) -> list[tuple[TrajectoryTurn, ...]]:
    """Every trajectory of a JSONL file, in file order (module docstring)."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ValueError(
            f"workload.trajectories={str(p)!r} cannot be read: {exc.strerror}"
        ) from None
    out: list[tuple[TrajectoryTurn, ...]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, Mapping) or "turns" not in record:
            raise ValueError(f'{where}: each line must be an object with a "turns" list')
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f'{where}: "turns" must be a non-empty list')
        out.append(tuple(_turn(f"{where} turn {i}", t) for i, t in enumerate(turns)))
    if not out:
        raise ValueError(f"{p}: holds no trajectory")
    return out
