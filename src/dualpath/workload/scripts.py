"""Agent scripts for the runtime and the load generator, from one trajectory synthesis: design §9
trajectories scaled down for a CPU model (``small_trajectories``), then either token ids
(``agent_scripts``: the runtime) or words for an HTTP chat (``chat_scripts``: ``loadgen``).

Every random draw comes from a ``random.Random`` seeded per agent, so the same seed gives the
same prompts in every system; generated tokens are the model's own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dualpath.config import WorkloadConfig
from dualpath.workload.mooncake import load_mooncake
from dualpath.workload.synth import synthesize
from dualpath.workload.trajectory import Trajectory, TrajectoryTurn


def agent_seed(seed: int, agent_id: int) -> int:
    """The seed of one agent's draws (its token ids, or its words)."""
    return seed * 1_000_003 + agent_id


def small_trajectories(
    cfg: WorkloadConfig,
    block_tokens: int,
    num_turns: int,
    token_scale: float = 0.25,
    max_gen_tokens: int = 16,
) -> list[Trajectory]:
    """``synthesize`` at MAL 32K, then keep ``num_turns`` turns, appends × ``token_scale`` and
    generations capped at ``max_gen_tokens``: contexts of a few thousand tokens."""
    if num_turns < 1:
        raise ValueError(f"num_turns={num_turns} is invalid: must be >= 1")
    if not 0 < token_scale <= 1:
        raise ValueError(f"token_scale={token_scale} is invalid: must be in (0, 1]")
    if max_gen_tokens < 1:
        raise ValueError(f"max_gen_tokens={max_gen_tokens} is invalid: must be >= 1")
    out = []
    for traj in synthesize(replace(cfg, mal="32k"), block_tokens):
        turns = tuple(
            TrajectoryTurn(
                max(1, round(t.append_tokens * token_scale)), min(t.gen_tokens, max_gen_tokens)
            )
            for t in traj.turns[:num_turns]
        )
        out.append(Trajectory(traj.agent_id, turns))
    return out


@dataclass(frozen=True, slots=True)
class AgentScript:
    """One agent for the runtime: the token ids it appends each turn and the tokens to
    generate each turn (its context grows by each append and the model's real output)."""

    agent_id: int
    appends: tuple[tuple[int, ...], ...]
    outputs: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.appends) != len(self.outputs):
            raise ValueError(
                f"AgentScript.outputs has {len(self.outputs)} turns, appends "
                f"{len(self.appends)}: must be equal"
            )


def agent_scripts(
    trajectories: Sequence[Trajectory], vocab_size: int, seed: int
) -> list[AgentScript]:
    """One script per trajectory, token ids drawn per agent from ``seed``."""
    scripts = []
    for traj in trajectories:
        rng = random.Random(agent_seed(seed, traj.agent_id))
        appends = tuple(
            tuple(rng.randrange(vocab_size) for _ in range(t.append_tokens)) for t in traj.turns
        )
        scripts.append(AgentScript(traj.agent_id, appends, tuple(t.gen_tokens for t in traj.turns)))
    return scripts


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One request of a chat script: words appended to the conversation, tokens to generate."""

    append_words: int
    max_tokens: int
    not_before_s: float = 0.0  # arrival time relative to the start (trace mode)


@dataclass(frozen=True, slots=True)
class ChatScript:
    """One agent / session over HTTP: its turns run in order, each after the previous one
    finished; ``seed`` draws its words."""

    session_id: str
    turns: tuple[ChatTurn, ...]
    seed: int


def chat_scripts(
    num_agents: int,
    num_turns: int,
    token_scale: float,
    max_gen_tokens: int,
    block_tokens: int = 64,
    seed: int = 0,
) -> list[ChatScript]:
    """The trajectories of ``small_trajectories`` as chat scripts (≈ one token per word)."""
    if num_agents < 1 or num_turns < 1:
        raise ValueError(f"--agents {num_agents} / --turns {num_turns}: both must be >= 1")
    if not 0 < token_scale <= 1:
        raise ValueError(f"--token-scale {token_scale} is invalid: must be in (0, 1]")
    if max_gen_tokens < 1:
        raise ValueError(f"--max-gen {max_gen_tokens} is invalid: must be >= 1")
    cfg = replace(
        WorkloadConfig(),
        num_agents=num_agents,
        num_base_trajectories=min(num_agents, 500),
        seed=seed,
    )
    return [
        ChatScript(
            f"agent-{traj.agent_id}",
            tuple(ChatTurn(t.append_tokens, t.gen_tokens) for t in traj.turns),
            agent_seed(seed, traj.agent_id),
        )
        for traj in small_trajectories(cfg, block_tokens, num_turns, token_scale, max_gen_tokens)
    ]


def trace_scripts(
    path: str, token_scale: float, max_gen_tokens: int, speedup: float, limit: int | None
) -> list[ChatScript]:
    """A Mooncake trace as one chat script per session; arrival times divided by ``speedup``
    (0: closed loop, arrivals ignored)."""
    if not 0 < token_scale <= 1:
        raise ValueError(f"--token-scale {token_scale} is invalid: must be in (0, 1]")
    requests = load_mooncake(path, block_tokens=1)
    if limit is not None:
        requests = requests[:limit]
    by_session: dict[int, list[ChatTurn]] = {}
    sent: dict[int, int] = {}
    for req in requests:
        words = max(1, round(req.prompt_tokens * token_scale))
        append = max(1, words - sent.get(req.session_id, 0))
        sent[req.session_id] = sent.get(req.session_id, 0) + append
        at = req.timestamp_s / speedup if speedup > 0 else 0.0
        by_session.setdefault(req.session_id, []).append(
            ChatTurn(append, min(req.output_tokens, max_gen_tokens), at)
        )
    return [ChatScript(f"session-{s}", tuple(t), s) for s, t in sorted(by_session.items())]
