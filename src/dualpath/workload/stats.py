"""Summary statistics of a set of trajectories, in the columns of SPEC §9's table.

Pure functions over trajectories; used by tests, the calibration and docs/workload.md.
``python -m dualpath.workload.calibrate`` prints the measured-vs-target table.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath.config.checks import require
from dualpath.workload.synth import (
    CALIBRATED,
    REPLICA_ROUND_MAX_TOKENS,
    SPEC_TABLE,
    mal_tokens,
    synthesize_base,
)
from dualpath.workload.trajectory import Trajectory, Turn, turn_requests


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """Per-trajectory means (turns, total) and turn-weighted means (append, gen, context)."""

    num_trajectories: int
    turns: float
    append_tokens: float  # over all turns, the first (system prompt + task) included
    later_append_tokens: float  # over turns after the first
    gen_tokens: float
    total_tokens: float  # final context: all appends and generations
    context_tokens: float  # mean prompt over all turns of all trajectories (turn-weighted)
    trajectory_context_tokens: float  # mean over trajectories of each one's mean prompt
    max_context_tokens: int  # largest prompt + generation of any turn
    hit_ratio: float  # sum of hit tokens / sum of prompt tokens (SPEC §3 hits)


def turns_stats(all_turns: Sequence[Sequence[Turn]], block_tokens: int = 64) -> WorkloadStats:
    """Statistics of trajectories given as their turn sequences."""
    require(len(all_turns) >= 1, "trajectories", len(all_turns), "at least one")
    num_turns = appends = later = gens = totals = prompts = hits = max_context = 0
    traj_context = 0.0
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
    )


def trajectory_stats(trajs: Sequence[Trajectory], block_tokens: int = 64) -> WorkloadStats:
    """Statistics of ``trajs`` (see ``WorkloadStats``)."""
    return turns_stats([t.turns for t in trajs], block_tokens)


def format_table(seed: int = 0, num_trajectories: int = 500, block_tokens: int = 64) -> str:
    """Markdown table: SPEC §9 target vs this synthesiser, per MAL."""
    lines = [
        "| MAL | | turns | append/turn | gen/turn | total | context | traj. context | "
        "max context | hit ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mal, target in SPEC_TABLE.items():
        cap = mal_tokens(mal) - REPLICA_ROUND_MAX_TOKENS
        turns = synthesize_base(random.Random(seed), CALIBRATED[mal], cap, num_trajectories)
        got = turns_stats(turns, block_tokens)
        lines.append(
            f"| {mal} | SPEC | {target.turns:.0f} | {target.append_tokens:.0f} | "
            f"{target.gen_tokens:.0f} | {target.total_tokens:,.0f} | "
            f"{target.context_tokens:,.0f} | | ≤ {mal_tokens(mal):,} | "
            f"{'98.7%' if mal == '64k' else 'n/a'} |"
        )
        lines.append(
            f"| {mal} | ours | {got.turns:.1f} | {got.append_tokens:.0f} "
            f"({got.later_append_tokens:.0f} after 1st) | {got.gen_tokens:.0f} | "
            f"{got.total_tokens:,.0f} | {got.context_tokens:,.0f} | "
            f"{got.trajectory_context_tokens:,.0f} | {got.max_context_tokens:,} | "
            f"{100 * got.hit_ratio:.2f}% |"
        )
    return "\n".join(lines)
