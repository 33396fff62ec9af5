"""Summary statistics of a set of trajectories, in the columns of design §9's table.

Pure functions over trajectories; used by tests, the calibration and docs/workload.md.
``python -m dualpath.workload.calibrate`` prints the measured-vs-target table.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.config.checks import require
from dualpath.workload.synth import SPEC_TABLE, base_set, mal_tokens
from dualpath.workload.trajectory import Trajectory, TrajectoryTurn, turn_requests


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """Per-trajectory means (turns, total, ``traj_*``) and turn-weighted means (the rest)."""

    num_trajectories: int
    turns: float
    append_tokens: float  # over all turns, the first (system prompt + task) included
    later_append_tokens: float  # over turns after the first
    gen_tokens: float
    total_tokens: float  # final context: all appends and generations
    context_tokens: float  # mean prompt over all turns of all trajectories (turn-weighted)
    trajectory_context_tokens: float  # mean over trajectories of each one's mean prompt
    max_context_tokens: int  # largest prompt + generation of any turn
    hit_ratio: float  # sum of hit tokens / sum of prompt tokens (design §3 hits)
    traj_append_tokens: float  # mean over trajectories of each one's mean append per turn
    traj_gen_tokens: float  # mean over trajectories of each one's mean generation per turn
    log_turns_sd: float  # population sd over trajectories of ln(turns)


def turns_stats(
    all_turns: Sequence[Sequence[TrajectoryTurn]], block_tokens: int = 64
) -> WorkloadStats:
    """Statistics of trajectories given as their turn sequences."""
    require(len(all_turns) >= 1, "trajectories", len(all_turns), "at least one")
    num_turns = appends = later = gens = totals = prompts = hits = max_context = 0
    traj_context = traj_append = traj_gen = 0.0
    log_turns = []
    for turns in all_turns:
        specs = turn_requests(Trajectory(0, tuple(turns)), block_tokens)
        traj_prompts = sum(s.prompt_tokens for s in specs)
        num_turns += len(specs)
        appends += sum(t.append_tokens for t in turns)
        later += sum(t.append_tokens for t in turns[1:])
        gens += sum(t.gen_tokens for t in turns)
        last = specs[-1]
        totals += last.prompt_tokens + last.output_tokens
        max_context = max(max_context, last.prompt_tokens + last.output_tokens)
        prompts += traj_prompts
        hits += sum(s.hit_tokens for s in specs)
        traj_context += traj_prompts / len(specs)
        traj_append += sum(t.append_tokens for t in turns) / len(turns)
        traj_gen += sum(t.gen_tokens for t in turns) / len(turns)
        log_turns.append(math.log(len(turns)))
    n = len(all_turns)
    return WorkloadStats(
        num_trajectories=n,
        turns=num_turns / n,
        append_tokens=appends / num_turns,
        later_append_tokens=later / max(1, num_turns - n),
        gen_tokens=gens / num_turns,
        total_tokens=totals / n,
        context_tokens=prompts / num_turns,
        trajectory_context_tokens=traj_context / n,
        max_context_tokens=max_context,
        hit_ratio=hits / prompts,
        traj_append_tokens=traj_append / n,
        traj_gen_tokens=traj_gen / n,
        log_turns_sd=statistics.pstdev(log_turns),
    )


def trajectory_stats(trajs: Sequence[Trajectory], block_tokens: int = 64) -> WorkloadStats:
    """Statistics of ``trajs`` (see ``WorkloadStats``)."""
    return turns_stats([t.turns for t in trajs], block_tokens)


def format_table(
    form: str = "table2", seed: int = 0, num_trajectories: int = 500, block_tokens: int = 64
) -> str:
    """Markdown table: design §9 target vs the ``form`` synthesiser, per MAL.

    "table2" rows read append, gen and context as per-trajectory means (the columns it
    matches); "per_turn" rows read them turn-weighted (the columns that form matched).
    """
    lines = [
        "| MAL | | turns | append/turn | gen/turn | total | context | sd ln(turns) | "
        "max context | hit ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mal, target in SPEC_TABLE.items():
        rng = random.Random(seed)
        got = turns_stats(
            base_set(form, mal, rng, num_trajectories, num_trajectories), block_tokens
        )
        per_traj = form == "table2"
        append = got.traj_append_tokens if per_traj else got.append_tokens
        gen = got.traj_gen_tokens if per_traj else got.gen_tokens
        context = got.trajectory_context_tokens if per_traj else got.context_tokens
        lines.append(
            f"| {mal} | paper | {target.turns:.0f} | {target.append_tokens:.0f} | "
            f"{target.gen_tokens:.0f} | {target.total_tokens:,.0f} | "
            f"{target.context_tokens:,.0f} | | ≤ {mal_tokens(mal):,} | "
            f"{'98.7%' if mal == '64k' else 'n/a'} |"
        )
        lines.append(
            f"| {mal} | {form} | {got.turns:.1f} | {append:.0f} | {gen:.0f} | "
            f"{got.total_tokens:,.0f} | {context:,.0f} | {got.log_turns_sd:.2f} | "
            f"{got.max_context_tokens:,} | {100 * got.hit_ratio:.2f}% |"
        )
    return "\n".join(lines)
