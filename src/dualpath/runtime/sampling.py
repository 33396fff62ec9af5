"""Token sampling on the engines (PE for token 1, DE for the rest): greedy, or temperature /
top-p with a per-request seeded ``torch.Generator``. Pure functions; no I/O, no clock.
torch is imported where it is used: the scheduler and storage processes carry
``SamplingParams`` in messages without importing it (start-up time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: nearby (seed, index) pairs give unrelated generator seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How an engine picks a request's tokens. ``temperature`` 0 is greedy (argmax, the
    runtime's default). ``stop_token_ids``: the DE ends the request after emitting one (EOS).
    ``first_index``: the position in its turn's output of this request's first token (> 0
    for a turn resumed after an engine fault, whose earlier tokens the client already has;
    ``history`` holds them when penalties or a grammar depend on them). Penalties and bias
    follow OpenAI: ``logit - count·frequency - [count > 0]·presence + bias``, counts over the
    turn's output. ``grammar``: llguidance's grammar text (``token_choice.py`` applies it).

    Draws are counter-based: output token i is drawn with a generator seeded from
    ``(seed, i)`` alone, so whichever engine draws it (the PE's first token, the DE's, a
    respawned engine's after a fault) the draw is the same: a resumed turn continues exactly
    the stream the fault-free one would have produced."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    first_index: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's and the top k
    grammar: str = ""  # an llguidance grammar the output must match ("" = free text)
    history: tuple[int, ...] = ()  # the turn's output before ``first_index`` (a resumed turn)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is invalid: must be in (0, 1]")
        if self.first_index < 0:
            raise ValueError(f"first_index={self.first_index} is invalid: must be >= 0")
        if self.history and len(self.history) != self.first_index:
            raise ValueError(
                f"history has {len(self.history)} tokens: it must be the turn's output before "
                f"first_index={self.first_index}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs} is invalid: must be >= 0 (or None)")

    def generator(self, index: int) -> torch.Generator:
        """The generator of this request's output token ``index`` (0: the PE's first)."""
        import torch

        seed = _mix64(_mix64(self.seed & _MASK64) ^ (self.first_index + index)) >> 1
        return torch.Generator().manual_seed(seed)


def sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from ``logits`` [vocab]: greedy at temperature 0, else nucleus sampling.

    Ties in the nucleus cut keep every token whose cumulative mass *before* it is < top_p."""
    import torch

    if temperature <= 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
