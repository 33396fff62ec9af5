"""Per-turn request state inside the simulator (mutable, private to the shell).

The policy sees only ``RequestInfo``; this object carries what the shell must remember to
carry out the policy's decisions and to stamp a ``TurnRecord``.
"""

from __future__ import annotations

from dualpath.types import ReadSide

NO_TIME = -1.0


class Req:
    """One turn of one agent. Times are simulated seconds (``NO_TIME`` until stamped)."""

    __slots__ = (
        "agent_id",
        "arrival_s",
        "cached_tokens",
        "de",
        "de_buffer_bytes",
        "de_read_tokens",
        "finish_s",
        "first_token_s",
        "hbm_tokens",
        "hit_tokens",
        "output_tokens",
        "pe",
        "pe_buffer_bytes",
        "pe_read_tokens",
        "prefill_start_s",
        "prompt_tokens",
        "read_done_s",
        "read_side",
        "read_start_s",
        "reads_left",
        "remaining_new_tokens",
        "request_id",
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
        self.reads_left = 0
        self.cached_tokens = hit_tokens  # KV that exists (hits, then computed chunks)
        self.remaining_new_tokens = prompt_tokens - hit_tokens
        self.pe_buffer_bytes = 0.0  # held in the PE buffer until prefill ends
        self.de_buffer_bytes = 0.0  # held in the DE buffer until H2D ends
        self.hbm_tokens = 0  # DE HBM reserved (prompt + output)
