"""The interface every shell drives: a Policy object per cluster (design §7)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dualpath.policy.commands import Assign, ForwardBatch
from dualpath.policy.view import ClusterView, RequestInfo


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """A request waiting in a PE's local queue whose hit KV is ready: ``cached`` tokens have KV,
    ``new`` tokens remain to be computed (after earlier chunks, ``cached`` grows)."""

    request_id: int
    cached: int
    new: int

    def __post_init__(self) -> None:
        if self.cached < 0 or self.new < 0:
            raise ValueError(
                f"request {self.request_id}: cached={self.cached}, new={self.new} is invalid: "
                "both must be >= 0"
            )


class Policy(Protocol):
    """Inter-engine scheduling (``submit`` + ``schedule``) and intra-engine batching
    (``plan_forward``). Deterministic: same calls in the same order ⇒ same decisions."""

    name: str
    layerwise: bool  # design §8: False ⇒ the shell passes kv_budget_tokens to plan_forward

    def submit(self, request: RequestInfo, now: float) -> None:
        """Append ``request`` to the global FIFO queue. ValueError on a bad request."""
        ...

    def schedule(self, view: ClusterView, now: float) -> list[Assign]:
        """One scheduling round: the PE group leaders pull (several at once: one pull over
        all their PEs), then every DE group leader (in group-id order). Returns fully
        assigned requests (PE, DE and read side fixed)."""
        ...

    def plan_forward(
        self,
        engine_id: int,
        queue: Sequence[PendingPrefill],
        now: float,
        kv_budget_tokens: int | None = None,
        cap_s: float | None = None,
    ) -> ForwardBatch:
        """Pack the next forward pass of PE ``engine_id`` from the FIFO ``queue``.

        ``kv_budget_tokens`` (non-layerwise systems): at most this many cached + new tokens
        may be resident in HBM for the batch. ``cap_s``: a predicted attention time below
        the compute quota that this pass must also stay within (``balance_cap``)."""
        ...

    def balance_cap(self, predicted: Sequence[float]) -> float | None:
        """Given the predicted attention time of every PE of an EP group's next pass (each
        packed to the quota), the cap the PEs above it are re-planned under, or None."""
        ...

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet fully assigned."""
        ...

    def decisions(self) -> list[dict[str, Any]]:
        """The decision trace so far (empty unless ``scheduler.record_decisions``)."""
        ...
