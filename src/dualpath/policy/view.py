"""What the scheduler sees: requests, engine and node states reported at a pull.

A view's states are plain data: they are checked once, where the view enters the policy
(``policy.state.ViewIndex.refresh`` with ``policy.view_checks``), not when a shell builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.types import EngineKind


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One turn of one agent, as submitted to the scheduler.

    ``hit_tokens`` is the prefix whose KV is on storage (a multiple of the block size);
    the remaining ``prompt_tokens - hit_tokens`` are computed. ``output_tokens`` is the
    forced generation length (the DE reserves HBM for prompt + output).
    """

    request_id: int
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    agent_id: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ValueError(
                f"request {self.request_id}: prompt_tokens={self.prompt_tokens} is invalid: must be > 0"
            )
        if not 0 <= self.hit_tokens <= self.prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: hit_tokens={self.hit_tokens} is invalid: "
                f"must be in 0..prompt_tokens ({self.prompt_tokens})"
            )
        if self.output_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: output_tokens={self.output_tokens} is invalid: must be >= 1"
            )

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


@dataclass(frozen=True, slots=True)
class EngineState:
    """An engine's report at a pull (design §7.1): ``seq`` = seq_e, ``tokens`` = tok_e.

    ``free_hbm_tokens`` (DEs): KV tokens that still fit in the engine's free HBM. Every
    count is an integer >= 0, and an engine with ``seq == 0`` has ``tokens == 0`` (checked
    by the policy when a view holding the state is scheduled).
    """

    engine_id: int
    node_id: int
    group_id: int
    kind: EngineKind
    seq: int = 0
    tokens: int = 0
    free_hbm_tokens: int = 0


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node's storage read queue, in hit tokens waiting to be read (``read_q``), and the
    bytes its storage NICs have read so far (``bytes_read``; only the optional
    ``least_read`` read-side tie-break looks at it, a shell may leave it 0): an integer >= 0
    and a finite float >= 0 (checked by the policy, as ``EngineState``'s)."""

    node_id: int
    kind: EngineKind
    read_queue_tokens: int = 0
    bytes_read: float = 0.0


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Everything reported at one pull. Tuples are sorted by id (the shell's duty).

    ``generated`` (optional) splits the DEs' tok_e in two: one tuple per DE group, in
    ascending group id order, of the tokens its members' turns generated so far (members in
    engine id order). A DE's tok_e is then its ``EngineState.tokens`` (the prompts of its
    turns) plus its entry here. This is how a shell reports the number that moves at every
    decode step: one new tuple per group that stepped, instead of a new state per member, so
    that a pull costs O(groups that stepped), not O(DEs). Empty (the default): every
    ``tokens`` is the whole tok_e.
    """

    engines: tuple[EngineState, ...]
    nodes: tuple[NodeState, ...]
    generated: tuple[tuple[int, ...], ...] = ()

    def engine_tokens(self) -> list[int]:
        """tok_e of every engine, in ``engines`` order (``tokens`` plus what ``generated``
        reports for a DE). O(engines): for journals, tests and reports, not for pulls."""
        tokens = [e.tokens for e in self.engines]
        if not self.generated:
            return tokens
        members: dict[int, list[int]] = {}
        de = EngineKind.DE
        for i, e in enumerate(self.engines):
            if e.kind is de:
                members.setdefault(e.group_id, []).append(i)
        for gid, values in zip(sorted(members), self.generated, strict=False):
            for i, g in zip(members[gid], values, strict=False):
                tokens[i] += g
        return tokens
