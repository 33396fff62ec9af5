"""A policy with every storage read forced to one side (``serve --engine vllm --read-side``):
a test and diagnosis knob. The wrapped policy still picks the PE and the DE; its decision
trace shows its own choice of side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dualpath.policy.base import PendingPrefill, Policy
from dualpath.policy.commands import Assign, ForwardBatch
from dualpath.policy.view import ClusterView, RequestInfo
from dualpath.types import ReadSide


class ForcedSide:
    """``policy`` with every read on ``side``, whatever it chose (``None``: as it chose); a
    ``Policy`` itself. ``side`` may change between schedules (the router's
    ``/v1/dualpath/read_side``)."""

    def __init__(self, policy: Policy, side: ReadSide | None) -> None:
        self.policy, self.side = policy, side
        self.name, self.layerwise = policy.name, policy.layerwise

    def submit(self, request: RequestInfo, now: float) -> None:
        self.policy.submit(request, now)

    def schedule(self, view: ClusterView, now: float) -> list[Assign]:
        return [self._forced(a) for a in self.policy.schedule(view, now)]

    def _forced(self, a: Assign) -> Assign:
        hit = a.pe_read_tokens + a.de_read_tokens
        if not hit or self.side is None or a.read_side is self.side:
            return a
        pe = hit if self.side is ReadSide.PE else 0
        return replace(a, read_side=self.side, pe_read_tokens=pe, de_read_tokens=hit - pe)

    def plan_forward(
        self,
        engine_id: int,
        queue: Sequence[PendingPrefill],
        now: float,
        kv_budget_tokens: int | None = None,
        cap_s: float | None = None,
    ) -> ForwardBatch:
        return self.policy.plan_forward(engine_id, queue, now, kv_budget_tokens, cap_s)

    def balance_cap(self, predicted: Sequence[float]) -> float | None:
        return self.policy.balance_cap(predicted)

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting

    def decisions(self) -> list[dict[str, Any]]:
        return self.policy.decisions()
