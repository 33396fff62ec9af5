"""Per-turn request state inside the simulator: the ledger's ``Turn`` plus what only the
simulator needs to carry out the policy's decisions (mutable, private to the shell)."""

from __future__ import annotations

from dualpath.ledger.turn import Turn


class Req(Turn):
    """``pe_buffer_bytes`` / ``de_buffer_bytes``: held in the PE buffer until prefill ends
    (classic passes: until the pass's loads into HBM land) / in the DE buffer until the H2D
    copy ends. Its progress (``kv_tokens``) and state are the ``Turn``'s."""

    __slots__ = ("de_buffer_bytes", "pe_buffer_bytes")

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
        super().__init__(
            request_id, agent_id, turn_index, prompt_tokens, hit_tokens, output_tokens, arrival_s
        )
        self.pe_buffer_bytes = 0.0
        self.de_buffer_bytes = 0.0
