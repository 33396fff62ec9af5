"""Agent trajectories (turns of append + forced generation) and their per-turn requests.

Owns the replay rule of design §9 and the hit rule of design §3; does no I/O and draws nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import require


@dataclass(frozen=True, slots=True)
class TrajectoryTurn:
    """One agent turn: ``append_tokens`` new prompt tokens (tool output, or system prompt + task
    on the first turn), then ``gen_tokens`` forced generated tokens (the next tool call)."""

    append_tokens: int
    gen_tokens: int

    def __post_init__(self) -> None:
        require(self.append_tokens >= 1, "TrajectoryTurn.append_tokens", self.append_tokens, ">= 1")
        require(self.gen_tokens >= 1, "TrajectoryTurn.gen_tokens", self.gen_tokens, ">= 1")


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One agent's whole trajectory. Tool latency and think time are zero (design §9)."""

    agent_id: int
    turns: tuple[TrajectoryTurn, ...]

    def __post_init__(self) -> None:
        require(self.agent_id >= 0, "Trajectory.agent_id", self.agent_id, ">= 0")
        require(len(self.turns) >= 1, "Trajectory.turns", len(self.turns), "at least one turn")

    @property
    def total_tokens(self) -> int:
        """Final context: every append and every generated token of the trajectory."""
        return sum(t.append_tokens + t.gen_tokens for t in self.turns)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """The request one turn sends: its whole prompt, the prefix whose KV is in storage, and the
    number of tokens to generate. ``prompt_tokens - hit_tokens`` tokens are prefilled."""

    turn_index: int
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        require(self.turn_index >= 0, "TurnSpec.turn_index", self.turn_index, ">= 0")
        require(self.prompt_tokens >= 1, "TurnSpec.prompt_tokens", self.prompt_tokens, ">= 1")
        require(
            0 <= self.hit_tokens < self.prompt_tokens,
            "TurnSpec.hit_tokens",
            self.hit_tokens,
            f"in [0, prompt_tokens={self.prompt_tokens})",
        )
        require(self.output_tokens >= 1, "TurnSpec.output_tokens", self.output_tokens, ">= 1")

    @property
    def new_tokens(self) -> int:
        """Prompt tokens that must be prefilled this turn (misses)."""
        return self.prompt_tokens - self.hit_tokens


def persisted_tokens(context_tokens: int, block_tokens: int) -> int:
    """KV tokens of a finished turn that storage holds: whole blocks only (design §3).

    ``context_tokens`` is prompt + generated; the last generated token was sampled but never
    fed back, so its KV does not exist: ``floor((context - 1) / block) * block``.
    """
    return (context_tokens - 1) // block_tokens * block_tokens


def turn_requests(traj: Trajectory, block_tokens: int) -> list[TurnSpec]:
    """The request of every turn of ``traj`` (design §9 replay, design §3 hits).

    prompt_i = sum of all appends and generations before turn i + append_i;
    hit_i = KV persisted by turn i-1 (``persisted_tokens(prompt_{i-1} + gen_{i-1})``), 0 for
    turn 0 (hits are within one trajectory only); output_i = gen_i.
    """
    require(block_tokens >= 1, "block_tokens", block_tokens, ">= 1")
    specs: list[TurnSpec] = []
    context = 0  # prompt + generation of every earlier turn
    for index, turn in enumerate(traj.turns):
        hit = persisted_tokens(context, block_tokens) if index > 0 else 0
        prompt = context + turn.append_tokens
        specs.append(TurnSpec(index, prompt, hit, turn.gen_tokens))
        context = prompt + turn.gen_tokens
    return specs
