"""The timeline of one served turn, as every shell records it, and its latency metrics.

Its latency metrics are those of ``metrics.latency`` (design §9); validates, never clamps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

from dualpath.config.checks import require
from dualpath.metrics import latency

# Timeline fields in the order they must be non-decreasing.
TIMELINE_FIELDS = (
    "arrival_s",
    "scheduled_s",
    "read_start_s",
    "read_done_s",
    "prefill_start_s",
    "first_token_s",
    "second_token_s",
    "finish_s",
)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """What happened to one turn (request), times in seconds from the run's start.

    arrival_s: the turn is submitted; scheduled_s: the scheduler assigned PE and DE;
    read_start_s / read_done_s: its hit KV read from storage into a buffer (equal when nothing
    is read); prefill_start_s: its first forward pass starts; first_token_s: prefill ends,
    the PE produced token 1; second_token_s: the DE's first decode step produced token 2
    (equal to first_token_s when output_tokens == 1); finish_s: the last token is out.
    The timeline must be non-decreasing in that order.
    """

    agent_id: int
    turn_index: int
    request_id: int
    arrival_s: float
    scheduled_s: float
    read_start_s: float
    read_done_s: float
    prefill_start_s: float
    first_token_s: float
    second_token_s: float
    finish_s: float
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    read_side: str

    def __post_init__(self) -> None:
        # fast path: one expression over every rule below (shells create one record per
        # turn, hundreds of thousands per run); anything off takes the checks that name it
        if not (
            0
            <= self.arrival_s
            <= self.scheduled_s
            <= self.read_start_s
            <= self.read_done_s
            <= self.prefill_start_s
            <= self.first_token_s
            <= self.second_token_s
            <= self.finish_s
            and self.agent_id >= 0
            and self.turn_index >= 0
            and self.request_id >= 0
            and self.output_tokens >= 1
            and 0 <= self.hit_tokens <= self.prompt_tokens
            and self.prompt_tokens >= 1
            and type(self.read_side) is str
            and self.read_side
            and (self.output_tokens != 1 or self.second_token_s == self.first_token_s)
        ):
            self._check()

    def _check(self) -> None:
        """Every rule of the record, in order: ValueError naming the first one broken; an
        ``Enum`` read side becomes its plain value."""
        self._reject_timeline()  # raises only where the timeline is out of order
        require(
            min(self.agent_id, self.turn_index, self.request_id) >= 0,
            "TurnRecord.agent_id/turn_index/request_id",
            (self.agent_id, self.turn_index, self.request_id),
            ">= 0",
        )
        require(self.prompt_tokens >= 1, "TurnRecord.prompt_tokens", self.prompt_tokens, ">= 1")
        require(
            0 <= self.hit_tokens <= self.prompt_tokens,
            "TurnRecord.hit_tokens",
            self.hit_tokens,
            f"in [0, prompt_tokens={self.prompt_tokens}]",
        )
        require(self.output_tokens >= 1, "TurnRecord.output_tokens", self.output_tokens, ">= 1")
        if isinstance(self.read_side, Enum):  # e.g. types.ReadSide: keep its plain value
            object.__setattr__(self, "read_side", str(self.read_side.value))
        require(
            isinstance(self.read_side, str) and bool(self.read_side),
            "TurnRecord.read_side",
            self.read_side,
            "a non-empty string (e.g. 'pe', 'de', 'none')",
        )
        if self.output_tokens == 1:
            require(
                self.second_token_s == self.first_token_s,
                "TurnRecord.second_token_s",
                self.second_token_s,
                f"== first_token_s={self.first_token_s} when output_tokens == 1",
            )

    def _reject_timeline(self) -> None:
        """Raise the ValueError naming the first out-of-order timestamp (NaN included), if any."""
        require(self.arrival_s >= 0, "TurnRecord.arrival_s", self.arrival_s, ">= 0")
        for earlier, later in itertools.pairwise(TIMELINE_FIELDS):
            value, bound = getattr(self, later), getattr(self, earlier)
            require(
                value >= bound,
                f"TurnRecord.{later}",
                value,
                f">= {earlier}={bound} (request {self.request_id})",
            )

    @property
    def ttft_s(self) -> float:
        """Time to first token (``metrics.latency``)."""
        return latency.ttft_s(self.arrival_s, self.first_token_s)

    @property
    def ttst_s(self) -> float | None:
        """First to second token (``metrics.latency``); None if output_tokens < 2."""
        return latency.ttst_s(self.first_token_s, self.second_token_s, self.output_tokens)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per token after the second (``metrics.latency``); None if output <= 2."""
        return latency.tpot_s(self.second_token_s, self.finish_s, self.output_tokens)

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency after the first token (``metrics.latency``)."""
        return latency.itl_s(self.first_token_s, self.finish_s, self.output_tokens)

    @property
    def queue_s(self) -> float:
        """TTFT component: waiting for the scheduler (scheduled_s - arrival_s)."""
        return self.scheduled_s - self.arrival_s

    @property
    def alloc_s(self) -> float:
        """TTFT component: assigned, waiting for buffer/read slot (read_start_s - scheduled_s)."""
        return self.read_start_s - self.scheduled_s

    @property
    def read_s(self) -> float:
        """TTFT component: reading hit KV from storage (read_done_s - read_start_s)."""
        return self.read_done_s - self.read_start_s

    @property
    def prefill_s(self) -> float:
        """TTFT component: read done → first token, incl. waiting for a forward pass."""
        return self.first_token_s - self.read_done_s
