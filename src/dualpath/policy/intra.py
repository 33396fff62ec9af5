"""Intra-engine scheduling (design §7.2): pack one PE forward pass under the compute quota,
chunking the request that would overflow it; per-GPU predictions for an EP group.

Pure: the attention predictor is injected (``(cached, bsz)`` pairs → seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dualpath.policy.base import PendingPrefill
from dualpath.policy.commands import Chunk, ForwardBatch

Predictor = Callable[[Sequence[tuple[int, int]]], float]


def pack_forward(
    engine_id: int,
    queue: Sequence[PendingPrefill],
    predict: Predictor,
    quota_s: float | None,
    kv_budget_tokens: int | None = None,
) -> ForwardBatch:
    """Pack requests FIFO while the predicted attention time stays ≤ ``quota_s`` (None: no
    quota) and, with ``kv_budget_tokens``, the resident cached + new tokens stay within it.

    The first request that does not fit whole is chunked to the largest ``bsz'`` that fits
    (binary search; the predictor is monotone in ``bsz``) and packing stops: the rest stays
    at the head. Progress is guaranteed: the head always fits the budget whole (a head whose
    cached + new tokens exceed ``kv_budget_tokens`` is refused with a ValueError: every chunk
    attends over all earlier KV, so no chunking lets it run within the budget), and if not
    even one of its tokens fits the quota, chunking cannot meet the quota, so the head runs
    alone with its whole remainder (the batch then exceeds the quota).
    """
    if kv_budget_tokens is not None and kv_budget_tokens < 0:
        raise ValueError(f"kv_budget_tokens={kv_budget_tokens} is invalid: must be >= 0 or None")
    if queue and kv_budget_tokens is not None:
        head = queue[0]
        if head.cached + head.new > kv_budget_tokens:
            raise ValueError(
                f"request {head.request_id}: cached + new = {head.cached} + {head.new} tokens "
                f"exceeds kv_budget_tokens={kv_budget_tokens} (engine {engine_id}); a "
                "non-layerwise pass holds all of a request's KV, and chunking does not "
                "shrink it: the request cannot be prefilled on this engine"
            )
    pairs: list[tuple[int, int]] = []
    chunks: list[Chunk] = []
    resident = 0
    for item in queue:
        cached, new = item.cached, item.new
        room = new
        if kv_budget_tokens is not None:
            room = min(new, kv_budget_tokens - resident - cached)
        if room == new and _fits(predict, pairs, cached, new, quota_s):
            take = new
        else:
            take = _largest_fit(predict, pairs, cached, max(room, 0), quota_s)
        if take <= 0 and (new > 0 or room < 0):  # nothing fits (not even its cached KV)
            break
        pairs.append((cached, take))
        chunks.append(Chunk(item.request_id, cached, take, is_last=take == new))
        resident += cached + take
        if take < new:
            break
    if not chunks and queue:  # not one token of the head fits the quota
        head = queue[0]
        pairs.append((head.cached, head.new))
        chunks.append(Chunk(head.request_id, head.cached, head.new, is_last=True))
    predicted = predict(pairs) if pairs else 0.0
    return ForwardBatch(engine_id, tuple(chunks), predicted)


def _fits(
    predict: Predictor, pairs: list[tuple[int, int]], cached: int, bsz: int, quota: float | None
) -> bool:
    return quota is None or predict([*pairs, (cached, bsz)]) <= quota


def _largest_fit(
    predict: Predictor, pairs: list[tuple[int, int]], cached: int, hi: int, quota: float | None
) -> int:
    """Largest b in [0, hi] with the batch plus (cached, b) within the quota (0 if none)."""
    if quota is None or hi <= 0:
        return max(hi, 0)
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(predict, pairs, cached, mid, quota):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class GroupForwardPlan:
    """The next forward pass of every PE of an EP group (engines in id order), with the
    predicted attention time per GPU; the group waits for its slowest GPU."""

    batches: tuple[ForwardBatch, ...]

    @property
    def per_gpu_s(self) -> tuple[float, ...]:
        return tuple(b.predicted_attention_s for b in self.batches)

    @property
    def max_s(self) -> float:
        return max(self.per_gpu_s, default=0.0)

    @property
    def mean_s(self) -> float:
        times = self.per_gpu_s
        return sum(times) / len(times) if times else 0.0

    @property
    def bubble_ratio(self) -> float:
        """max / mean predicted attention time (1.0 = perfectly balanced; 1.0 when idle)."""
        mean = self.mean_s
        return self.max_s / mean if mean > 0 else 1.0

    @property
    def bubble_s(self) -> float:
        """GPU-seconds the group idles at the sync point: Σ (max − t_gpu)."""
        peak = self.max_s
        return sum(peak - t for t in self.per_gpu_s)


def median_cap(predicted: Sequence[float], floor_s: float) -> float | None:
    """The attention cap of a ``pass_balance="median"`` pass: the median of the predicted
    attention times of the PEs with work (the lower one of an even count: of two, the
    shorter), at least ``floor_s``. None when fewer than two PEs have work (nothing to
    balance against)."""
    busy = sorted(t for t in predicted if t > 0.0)
    if len(busy) < 2:
        return None
    return max(busy[(len(busy) - 1) // 2], floor_s)


def plan_group(
    plan_one: Callable[[int, Sequence[PendingPrefill], float | None], ForwardBatch],
    queues: Mapping[int, Sequence[PendingPrefill]],
    cap: Callable[[Sequence[float]], float | None] = lambda _: None,
) -> GroupForwardPlan:
    """Plan every engine's next forward pass with ``plan_one(engine id, queue, cap_s)``: first
    each to the quota (``cap_s`` None); then, where ``cap`` of the predicted times gives a
    cap, the engines above it again under that cap (the rest of their queue waits)."""
    engines = sorted(queues)
    first = [plan_one(e, queues[e], None) for e in engines]
    limit = cap([b.predicted_attention_s for b in first])
    if limit is None:
        return GroupForwardPlan(tuple(first))
    return GroupForwardPlan(
        tuple(
            plan_one(e, queues[e], limit) if b.predicted_attention_s > limit else b
            for e, b in zip(engines, first, strict=True)
        )
    )
