"""Agent scripts for the runtime: SPEC §9 trajectories, scaled down, with concrete token ids.

Token ids of every append are drawn from ``random.Random`` seeded per agent, so the same
workload seed gives the same prompts in every system; generated tokens are the model's own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from dualpath.config import WorkloadConfig
from dualpath.runtime.requests import AgentState
from dualpath.workload import Trajectory, Turn, synthesize


def small_trajectories(
    cfg: WorkloadConfig,
    block_tokens: int,
    num_turns: int,
    token_scale: float = 0.25,
    max_gen_tokens: int = 16,
) -> list[Trajectory]:
    """``synthesize`` then keep ``num_turns`` turns, appends × ``token_scale`` and generations
    capped at ``max_gen_tokens``: contexts of a few thousand tokens for a CPU model."""
    if num_turns < 1:
        raise ValueError(f"num_turns={num_turns} is invalid: must be >= 1")
    if not 0 < token_scale <= 1:
        raise ValueError(f"token_scale={token_scale} is invalid: must be in (0, 1]")
    if max_gen_tokens < 1:
        raise ValueError(f"max_gen_tokens={max_gen_tokens} is invalid: must be >= 1")
    base = synthesize(replace(cfg, mal="32k"), block_tokens)
    out = []
    for traj in base:
        turns = tuple(
            Turn(max(1, round(t.append_tokens * token_scale)), min(t.gen_tokens, max_gen_tokens))
            for t in traj.turns[:num_turns]
        )
        out.append(Trajectory(traj.agent_id, turns))
    return out


def agent_scripts(
    trajectories: Sequence[Trajectory], vocab_size: int, seed: int
) -> list[AgentState]:
    """One ``AgentState`` per trajectory with token ids drawn per agent from ``seed``."""
    agents = []
    for traj in trajectories:
        rng = random.Random(seed * 1_000_003 + traj.agent_id)
        appends = tuple(
            tuple(rng.randrange(vocab_size) for _ in range(t.append_tokens)) for t in traj.turns
        )
        agents.append(AgentState(traj.agent_id, appends, tuple(t.gen_tokens for t in traj.turns)))
    return agents
