"""Seeded synthesiser of agentic trajectories matching design §9's per-MAL statistics.

Owns the generative model, its two calibrated forms ("table2", "per_turn") and their
constants; draws only from an injected ``random.Random``. See docs/workload.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from types import MappingProxyType

from dualpath.config.checks import one_of, require
from dualpath.config.workload import SYNTH_FORMS, WorkloadConfig
from dualpath.units import parse_tokens
from dualpath.workload.custom import load_distributions, load_trajectories
from dualpath.workload.trajectory import Trajectory, TrajectoryTurn

# Shape constants of the model (log-space standard deviations), chosen for plausibility,
# not fitted: tool outputs are heavy-tailed, tool calls less so, tasks differ in verbosity.
FIRST_APPEND_SIGMA = 0.35  # system prompt + task
PLANNED_TURNS_SIGMA = 0.5  # turns the task would take if the context never ran out
APPEND_SIGMA = 1.0  # tool output per turn
GEN_SIGMA = 0.6  # generated tool call per turn
VERBOSITY_SIGMA = 0.3  # per-trajectory factor on appends and generations ("per_turn")
# Room kept below the MAL for the random round prepended to replicated agents.
REPLICA_ROUND_MAX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class MalTarget:
    """One row of design §9's table (per trajectory; append, gen and context per turn)."""

    turns: float
    append_tokens: float
    gen_tokens: float
    total_tokens: float
    context_tokens: float


SPEC_TABLE: Mapping[str, MalTarget] = MappingProxyType(
    {
        "32k": MalTarget(60, 608, 148, 28_639, 17_183),
        "48k": MalTarget(106, 474, 172, 42_607, 25_120),
        "64k": MalTarget(157, 429, 176, 55_958, 32_721),
    }
)


@dataclass(frozen=True, slots=True)
class SynthParams:
    """Means of the generative model's distributions (see ``base_turns``)."""

    first_append_mean_tokens: float
    planned_turns_mean: float
    append_mean_tokens: float
    gen_mean_tokens: float
    verbosity_sigma: float = VERBOSITY_SIGMA  # log-space sd of the per-trajectory factor

    def __post_init__(self) -> None:
        require(
            self.verbosity_sigma >= 0, "SynthParams.verbosity_sigma", self.verbosity_sigma, ">= 0"
        )
        for name in (
            "first_append_mean_tokens",
            "planned_turns_mean",
            "append_mean_tokens",
            "gen_mean_tokens",
        ):
            value = getattr(self, name)
            require(value >= 1, f"SynthParams.{name}", value, ">= 1")


# "per_turn" form. Calibrated by dualpath.workload.calibrate (20,000 trajectories, seed
# 12345) so that the mean turns, total tokens and turn-weighted context match SPEC_TABLE;
# append:gen keeps the table's ratio. Re-run calibrate after changing the model.
CALIBRATED: Mapping[str, SynthParams] = MappingProxyType(
    {
        "32k": SynthParams(5_240, 90, 343, 83),
        "48k": SynthParams(6_527, 152, 267, 97),
        "64k": SynthParams(7_788, 219, 230, 95),
    }
)


# "table2" form (the default). Calibrated by ``python -m dualpath.workload.calibrate table2 --fit``
# (10,000 trajectories, 24 iterations, seed 12345) so that all five columns of SPEC_TABLE match as
# per-trajectory means; the fifth constant, verbosity_sigma, sets the spread of turns that
# the table implies (docs/workload.md derives it). Re-run calibrate after changing the model.
TABLE2_CALIBRATED: Mapping[str, SynthParams] = MappingProxyType(
    {
        "32k": SynthParams(5_887, 112, 481, 148, 0.82),
        "48k": SynthParams(7_793, 188, 369, 172, 0.848),
        "64k": SynthParams(9_681, 272, 336, 176, 0.914),
    }
)


def mal_tokens(mal: str) -> int:
    """'64k' → 65536: the maximum agent context length in tokens."""
    return parse_tokens(mal.lower())


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given arithmetic mean."""
    return math.exp(rng.gauss(math.log(mean) - sigma * sigma / 2, sigma))


def base_turns(
    rng: random.Random, params: SynthParams, cap_tokens: int
) -> tuple[TrajectoryTurn, ...]:
    """One "per_turn" trajectory: verbosity and planned turns drawn freely, then the turns.

    The task plans a lognormal number of turns; the rollout stops earlier when the next turn
    would push the context (prompt + generation) past ``cap_tokens`` (truncation at the MAL).
    """
    verbosity = _lognormal(rng, 1.0, params.verbosity_sigma)
    planned = max(2, round(_lognormal(rng, params.planned_turns_mean, PLANNED_TURNS_SIGMA)))
    return draw_turns(rng, params, cap_tokens, verbosity, planned)


def draw_turns(
    rng: random.Random, params: SynthParams, cap_tokens: int, verbosity: float, planned: int
) -> tuple[TrajectoryTurn, ...]:
    """A large first append, then lognormal appends and generations scaled by ``verbosity``,
    for up to ``planned`` turns or until the next turn would pass ``cap_tokens``."""
    first = round(_lognormal(rng, params.first_append_mean_tokens, FIRST_APPEND_SIGMA))
    first = min(max(1, first), cap_tokens // 2)
    gen_mu = math.log(params.gen_mean_tokens * verbosity) - GEN_SIGMA * GEN_SIGMA / 2
    app_mu = math.log(params.append_mean_tokens * verbosity) - APPEND_SIGMA * APPEND_SIGMA / 2
    gauss, exp = rng.gauss, math.exp
    gen = min(max(1, round(exp(gauss(gen_mu, GEN_SIGMA)))), cap_tokens - first)
    turns = [TrajectoryTurn(first, gen)]
    context = first + gen
    while len(turns) < planned:
        append = max(1, round(exp(gauss(app_mu, APPEND_SIGMA))))
        gen = max(1, round(exp(gauss(gen_mu, GEN_SIGMA))))
        if context + append + gen > cap_tokens:
            break
        turns.append(TrajectoryTurn(append, gen))
        context += append + gen
    return tuple(turns)


def _stratified_lognormal(
    rng: random.Random, mean: float, sigma: float, strata: list[int]
) -> list[float]:
    """One lognormal draw (arithmetic mean ``mean``) per stratum index, jittered within it.

    Stratum ``s`` of ``n`` covers the quantiles [s/n, (s+1)/n): a set of n draws then covers
    the distribution evenly, so its mean has far less sampling noise than n free draws.
    """
    n, unit, mu = len(strata), NormalDist(), math.log(mean) - sigma * sigma / 2
    out = []
    for s in strata:
        q = min(max((s + rng.random()) / n, 1e-9), 1 - 1e-9)
        out.append(math.exp(mu + sigma * unit.inv_cdf(q)))
    return out


def synthesize_base_table2(
    rng: random.Random, params: SynthParams, cap_tokens: int, num_strata: int, count: int
) -> list[tuple[TrajectoryTurn, ...]]:
    """The first ``count`` of ``num_strata`` "table2" trajectories, in draw order.

    Verbosity and planned turns are stratified over ``num_strata`` trajectories (a Latin
    hypercube: one stratum of each per trajectory, independently shuffled), then each
    trajectory's turns are drawn as in ``draw_turns``. ``count <= num_strata`` keeps a prefix.
    """
    require(1 <= count <= num_strata, "count", count, f"in [1, {num_strata}]")
    v_strata, p_strata = list(range(num_strata)), list(range(num_strata))
    rng.shuffle(v_strata)
    rng.shuffle(p_strata)
    verbosity = _stratified_lognormal(rng, 1.0, params.verbosity_sigma, v_strata)
    planned = _stratified_lognormal(rng, params.planned_turns_mean, PLANNED_TURNS_SIGMA, p_strata)
    return [
        draw_turns(rng, params, cap_tokens, verbosity[k], max(2, round(planned[k])))
        for k in range(count)
    ]


def synthesize_base(
    rng: random.Random, params: SynthParams, cap_tokens: int, num_trajectories: int
) -> list[tuple[TrajectoryTurn, ...]]:
    """``num_trajectories`` independent "per_turn" trajectories' turns, in draw order."""
    return [base_turns(rng, params, cap_tokens) for _ in range(num_trajectories)]


def base_set(
    form: str, mal: str, rng: random.Random, num_base: int, count: int
) -> list[tuple[TrajectoryTurn, ...]]:
    """The first ``count`` of ``num_base`` base trajectories of the ``form`` synthesiser."""
    one_of("workload.synth", form, SYNTH_FORMS)
    cap = mal_tokens(mal) - REPLICA_ROUND_MAX_TOKENS
    if form == "table2":
        return synthesize_base_table2(rng, TABLE2_CALIBRATED[mal], cap, num_base, count)
    return synthesize_base(rng, CALIBRATED[mal], cap, count)


def replica_round(rng: random.Random) -> TrajectoryTurn:
    """The random-token round prepended to a replicated agent (design §9): gen = 1."""
    return TrajectoryTurn(rng.randint(1, REPLICA_ROUND_MAX_TOKENS - 1), 1)


def synthesize(cfg: WorkloadConfig, block_tokens: int) -> list[Trajectory]:
    """``cfg.num_agents`` trajectories of MAL ``cfg.mal``, agent ids 0..n-1, seeded by ``cfg.seed``
    (from ``cfg.trajectories`` / ``cfg.distributions`` when set: ``workload.custom``).

    ``cfg.num_base_trajectories`` base trajectories are drawn; agent k < base uses base k as
    is; agent k >= base reuses base ``k % base`` with one random round prepended (append drawn
    in [1, 255], gen 1) so no two agents share a prefix. Every trajectory's context stays
    <= the MAL. The trajectories do not depend on ``block_tokens`` (validated only).
    """
    require(block_tokens >= 1, "block_tokens", block_tokens, ">= 1")
    mal = cfg.mal.lower()
    num_base = min(cfg.num_base_trajectories, cfg.num_agents)
    rng = random.Random(cfg.seed)
    if cfg.trajectories:  # the file's trajectories are the base set, in file order
        bases = load_trajectories(cfg.trajectories)
        num_base = min(len(bases), cfg.num_agents)
        bases = bases[:num_base]
    elif cfg.distributions:
        dists = load_distributions(cfg.distributions)
        cap = mal_tokens(mal) - REPLICA_ROUND_MAX_TOKENS
        bases = [dists.draw_turns(rng, cap) for _ in range(num_base)]
    else:
        bases = base_set(cfg.synth, mal, rng, cfg.num_base_trajectories, num_base)
    out = [Trajectory(k, turns) for k, turns in enumerate(bases)]
    for k in range(num_base, cfg.num_agents):
        out.append(Trajectory(k, (replica_round(rng), *bases[k % num_base])))
    return out
