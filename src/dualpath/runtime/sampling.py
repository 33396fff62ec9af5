"""Token sampling shared by the engines and the in-process server: greedy, or temperature /
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


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How an engine picks a request's tokens. ``temperature`` 0 is greedy (argmax, the
    runtime's default). ``stop_token_ids``: the DE ends the request after emitting one (EOS)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is invalid: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is invalid: must be in (0, 1]")

    def generator(self, stream: int) -> torch.Generator:
        """The request's generator for ``stream`` (0: the PE's first token, 1: the DE's)."""
        import torch

        return torch.Generator().manual_seed((self.seed * 2 + stream) % 2**63)


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


def pick(logits: Tensor, params: SamplingParams | None, generator: torch.Generator | None) -> int:
    """``sample`` with ``params``, or argmax when the request has none (greedy)."""
    if params is None or generator is None or params.temperature <= 0.0:
        return int(logits.argmax())
    return sample(logits, params.temperature, params.top_p, generator)
