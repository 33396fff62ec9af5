"""One turn's shared state: ids, sizes, its lifecycle state (``lifecycle.Phase``), the policy's
decision, its progress and its timeline.

Both shells keep a ``Turn`` per request (the simulator's ``Req`` extends it with what only the
simulator needs); the ledger moves it through its phases and builds its ``TurnRecord``.
"""

from __future__ import annotations

from dualpath.ledger.lifecycle import Phase
from dualpath.metrics import TurnRecord
from dualpath.policy import RequestInfo
from dualpath.types import ReadSide, ReuseSource

NO_TIME = -1.0


def usable_hit_tokens(stored_tokens: int, prompt_tokens: int, block_tokens: int) -> int:
    """The hit a turn may use of the ``stored_tokens`` the store has of its prompt: whole
    blocks, and never the whole prompt (a prefill computes at least one token, the one that
    produces token 1): a prompt of exactly k blocks hits at most k − 1."""
    return min(stored_tokens, (prompt_tokens - 1) // block_tokens * block_tokens)


class Turn:
    """One turn of one agent. Times are seconds on the shell's clock (``NO_TIME`` until
    stamped); ``pe`` / ``de`` are -1 until assigned."""

    __slots__ = (
        "agent_id",
        "arrival_s",
        "cancelled",
        "de",
        "de_prefetch_tokens",
        "de_read_tokens",
        "finish_s",
        "first_token_s",
        "hit_tokens",
        "kv_tokens",
        "loaded",
        "output_tokens",
        "pe",
        "pe_read_tokens",
        "phase",
        "prefill_start_s",
        "prompt_tokens",
        "read_done_s",
        "read_side",
        "read_start_s",
        "reads_left",
        "request_id",
        "reuse_engine",
        "reuse_node",
        "reuse_source",
        "reuse_tokens",
        "scheduled_s",
        "second_token_s",
        "turn_index",
    )

    def __init__(
        self,
        request_id: int,
        agent_id: int,
        turn_index: int,
        prompt_tokens: int,
        hit_tokens: int,
        output_tokens: int,
        arrival_s: float,
    ) -> None:
        self.request_id = request_id
        self.agent_id = agent_id
        self.turn_index = turn_index
        self.prompt_tokens = prompt_tokens
        self.hit_tokens = hit_tokens
        self.output_tokens = output_tokens
        self.arrival_s = arrival_s
        self.phase = Phase.QUEUED
        self.scheduled_s = NO_TIME
        self.read_start_s = NO_TIME
        self.read_done_s = NO_TIME
        self.prefill_start_s = NO_TIME
        self.first_token_s = NO_TIME
        self.second_token_s = NO_TIME
        self.finish_s = NO_TIME
        self.pe = -1
        self.de = -1
        self.read_side = ReadSide.NONE
        self.pe_read_tokens = 0
        self.de_read_tokens = 0
        self.reads_left = 0  # storage reads (one per node read from) not yet done
        # the reuse designs (``Assign``): hits found without storage, and a DE's own read
        self.reuse_source = ReuseSource.NONE
        self.reuse_node = -1
        self.reuse_engine = -1  # the DE whose HBM holds them (d2p)
        self.reuse_tokens = 0
        self.de_prefetch_tokens = 0
        # prompt tokens whose KV exists: its hits once read, then each computed chunk
        self.kv_tokens = 0
        self.loaded = False  # its DE admitted it and reports its HBM use (runtime shells)
        self.cancelled = False  # cancelled while QUEUED: aborted when the policy assigns it

    @property
    def new_tokens_left(self) -> int:
        """Prompt tokens still to compute (its prefill's remaining chunks)."""
        return self.prompt_tokens - self.kv_tokens

    @property
    def hbm_tokens(self) -> int:
        """DE HBM the turn reserves from assignment until it leaves: prompt + output."""
        return self.prompt_tokens + self.output_tokens

    def info(self) -> RequestInfo:
        """What the policy sees of this turn."""
        return RequestInfo(
            self.request_id,
            self.prompt_tokens,
            self.hit_tokens,
            self.output_tokens,
            self.arrival_s,
            self.agent_id,
        )

    def record(self) -> TurnRecord:
        """The finished turn's ``TurnRecord`` (ValueError if its timeline is out of order)."""
        return TurnRecord(
            agent_id=self.agent_id,
            turn_index=self.turn_index,
            request_id=self.request_id,
            arrival_s=self.arrival_s,
            scheduled_s=self.scheduled_s,
            read_start_s=self.read_start_s,
            read_done_s=self.read_done_s,
            prefill_start_s=self.prefill_start_s,
            first_token_s=self.first_token_s,
            second_token_s=self.second_token_s,
            finish_s=self.finish_s,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            output_tokens=self.output_tokens,
            read_side=self.read_side.value,
        )
