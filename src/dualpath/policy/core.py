"""The policy object every shell drives (design §7): queues, rounds, and the three rules wired.

Owns the global FIFO queue, requests that hold a PE while waiting for a DE, and the decision
trace. Deterministic: no clock (``now`` is an argument), no randomness, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dualpath.policy.base import PendingPrefill
from dualpath.policy.commands import Assign, ForwardBatch
from dualpath.policy.decode import DecodeRule, Held, Placed
from dualpath.policy.intra import (
    GroupForwardPlan,
    Predictor,
    median_cap,
    pack_forward,
    plan_group,
)
from dualpath.policy.params import PolicyParams
from dualpath.policy.prefill import PrefillRule
from dualpath.policy.reuse import ReuseRule
from dualpath.policy.side import SideRule
from dualpath.policy.state import RoundState, ViewIndex
from dualpath.policy.trace import DecisionTrace
from dualpath.policy.view import ClusterView, RequestInfo

ALL_GROUPS = -1  # the group id of a pull made for several PE groups at once


class PolicyCore:
    """One policy instance per cluster; implements ``dualpath.policy.base.Policy``.

    A round (``schedule``): the PE group leaders pull from the global queue (several leaders
    in one round: one pull over the union of their PEs, group id ``ALL_GROUPS`` in the
    trace), then every DE group pulls; a request that got a PE but no
    DE keeps its PE (its tokens count in that PE's tok_e / seq_e in later rounds) and waits in
    the DE queue. Only requests with PE, DE and read side fixed come back, as ``Assign``s, in
    decision order.
    """

    def __init__(
        self,
        name: str,
        params: PolicyParams,
        prefill: PrefillRule,
        decode: DecodeRule,
        side: SideRule,
        predict: Predictor,
        layerwise: bool,
        reuse: ReuseRule | None = None,
    ) -> None:
        self.name = name
        # where hits are found without storage (``policy.reuse``; None: the paper's systems)
        self.reuse = reuse
        self.params = params
        self.layerwise = layerwise
        self._prefill = prefill
        self._decode = decode
        self._side = side
        self._predict = predict
        self._queue: deque[RequestInfo] = deque()
        self._de_queue: deque[Held] = deque()
        self._holds: dict[int, list[int]] = {}  # PE id → [tokens, requests] held for it
        self._ids: set[int] = set()  # request ids submitted and not yet assigned
        self._trace = DecisionTrace(params.record_decisions)
        self._index = ViewIndex()  # the last view that passed validation, indexed

    @property
    def alpha_tokens(self) -> int:
        return self.params.alpha_tokens

    @property
    def beta_tokens(self) -> int:
        return self.params.beta_tokens

    @property
    def num_waiting(self) -> int:
        return len(self._ids)

    @property
    def num_holding_pe(self) -> int:
        """Requests that have a PE and wait for a DE."""
        return len(self._ids) - len(self._queue)

    def submit(self, request: RequestInfo, now: float) -> None:
        if not isinstance(request, RequestInfo):
            raise ValueError(f"submit: expected a RequestInfo, got {type(request).__name__}")
        rid = request.request_id
        if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0:
            raise ValueError(f"submit: request_id={rid!r} is invalid: must be an integer >= 0")
        if rid in self._ids:
            raise ValueError(f"submit: request {rid} is already waiting: ids must be unique")
        self._ids.add(rid)
        self._queue.append(request)

    def submit_many(self, requests: Iterable[RequestInfo], now: float) -> None:
        for r in requests:
            self.submit(r, now)

    def write_node(self, pe_node: int, de_node: int, written: Mapping[int, float]) -> int:
        """The node whose storage NIC persists a placed request's new prompt blocks
        (``SideRule.write_node``; ``written``: bytes given to each node's SNIC to write)."""
        return self._side.write_node(pe_node, de_node, written)

    def schedule(self, view: ClusterView, now: float) -> list[Assign]:
        holds = {pe: h[1] for pe, h in self._holds.items()}
        self._index.refresh(view, holds, self._decode.queued_by_group())
        st = RoundState(self._index, {pe: (h[0], h[1]) for pe, h in self._holds.items()})
        held: list[tuple[RequestInfo, int]] = []
        ids = st.pe_group_ids
        if len(ids) == 1:  # the group leader pulls
            self._prefill.pull(
                ids[0], st.pe_groups[ids[0]], st, self._queue, held, now, self._trace
            )
        elif ids:  # leaders pulling in one round: one pull over all their PEs
            self._prefill.pull(ALL_GROUPS, st.all_pes, st, self._queue, held, now, self._trace)
        for r, pe in held:
            h = self._holds.setdefault(pe, [0, 0])
            h[0] += r.prompt_tokens
            h[1] += 1
        self._de_queue.extend(held)
        placed: list[Placed] = []
        self._decode.round(st, self._de_queue, placed, now, self._trace)
        return [self._finish(r, pe, de, st, now) for r, pe, de in placed]

    def _finish(self, r: RequestInfo, pe: int, de: int, st: RoundState, now: float) -> Assign:
        if self.reuse is not None:
            a = self.reuse.assign(r, pe, de, st, self._side, now)
        else:
            plan = self._side.choose(r, pe, de, st)
            a = Assign(r.request_id, pe, de, plan.side, plan.pe_tokens, plan.de_tokens)
        h = self._holds[pe]
        h[0] -= r.prompt_tokens
        h[1] -= 1
        if not h[1]:
            del self._holds[pe]
        self._ids.discard(r.request_id)
        if self._trace.enabled:
            pe_node, de_node = st.node[pe], st.node[de]
            self._trace.add(
                "side",
                now,
                request=r.request_id,
                rule=self._side.rule,
                pe=pe,
                de=de,
                pe_node=pe_node,
                de_node=de_node,
                hit_tokens=r.hit_tokens,
                pe_read_q_before=st.read_q[pe_node] - a.pe_read_tokens,
                de_read_q_before=st.read_q[de_node] - a.de_read_tokens - a.de_prefetch_tokens,
                side=a.read_side.value,
                pe_read_tokens=a.pe_read_tokens,
                de_read_tokens=a.de_read_tokens,
            )
            if a.reuse_tokens or a.recompute_tokens or a.de_prefetch_tokens:
                self._trace.add(
                    "reuse",
                    now,
                    request=r.request_id,
                    mechanism=self.reuse.name if self.reuse else "",
                    source=a.reuse_source.value,
                    holder_node=a.reuse_node,
                    reuse_tokens=a.reuse_tokens,
                    recompute_tokens=a.recompute_tokens,
                    de_prefetch_tokens=a.de_prefetch_tokens,
                )
        return a

    def plan_forward(
        self,
        engine_id: int,
        queue: Sequence[PendingPrefill],
        now: float,
        kv_budget_tokens: int | None = None,
        cap_s: float | None = None,
    ) -> ForwardBatch:
        quota = self.params.compute_quota_s
        if cap_s is not None:
            quota = cap_s if quota is None else min(quota, cap_s)
        return pack_forward(engine_id, queue, self._predict, quota, kv_budget_tokens)

    def balance_cap(self, predicted: Sequence[float]) -> float | None:
        if self.params.pass_balance == "median":
            return median_cap(predicted, self.params.balance_floor_s)
        return None

    def plan_group(
        self,
        queues: Mapping[int, Sequence[PendingPrefill]],
        now: float,
        kv_budget_tokens: int | None = None,
    ) -> GroupForwardPlan:
        """Every PE of an EP group plans its next pass; per-GPU predictions and bubble ratio."""
        return plan_group(
            lambda e, q, cap: self.plan_forward(e, q, now, kv_budget_tokens, cap),
            queues,
            self.balance_cap,
        )

    def decisions(self) -> list[dict[str, Any]]:
        return list(self._trace.records)
