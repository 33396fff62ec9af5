"""Fast evaluation of ``cost.decode_step_time_s`` for one (model, hardware, EP size).

The decode loop evaluates the step time of every DE at every step; the cost model's generic
function re-derives constants on each call. ``StepTime`` hoists them and re-states the same
formula; at construction it checks itself against the cost model on a grid of points and
falls back to the cost model if any differs (so a cost-model change can never go unnoticed
into a wrong result). ``fast_step_time`` says whether the fast form holds; a test requires
it for every preset, so a fallback (correct but slow) cannot go unnoticed either.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.models import cost
from dualpath.types import AttentionKind

_CHECK_BATCHES = (1, 2, 3, 7, 16, 33, 64, 200)
_CHECK_MEAN_CONTEXTS = (1, 63, 500, 1023, 1024, 2047, 2048, 2049, 5000, 32_000, 131_072)
_REL_TOL = 1e-12


StepTime = Callable[[int, int], float]
# (batch, context, start, stop, extra) -> step times + extra of steps start..stop-1
StepColumn = Callable[[int, int, int, int, float], list[float]]


def _fast(model: ModelConfig, hw: HardwareConfig, num_gpus: int) -> tuple[StepTime, StepColumn]:
    sparse = model.attention_kind is AttentionKind.MLA_SPARSE
    per_token = float(cost.kv_bytes_per_token(model))
    index_key = float(cost.indexer_key_bytes_per_token(model))  # read over the whole context
    topk = float(model.sparse_topk)
    weight_bytes = cost.weight_bytes_per_gpu(model, num_gpus)
    bandwidth = hw.hbm_bytes_per_s * hw.hbm_efficiency
    kv_slowdown = cost.kv_read_slowdown(hw)
    peak = (hw.gpu_fp8_flops if model.compute_dtype == "fp8" else hw.gpu_bf16_flops) * hw.linear_mfu
    linear_per_token = cost.linear_flops(model, 1)
    overhead = hw.decode_step_overhead_s + cost.ep_forward_latency_s(model, hw, num_gpus)
    main_per_pair = cost.attention_main_flops(model, 0, 1)  # one query, one key: all layers
    index_per_pair = cost.indexer_flops(model, 0, 1)
    cap = model.sparse_topk

    def step_time_s(batch: int, context: int) -> float:
        if batch <= 0:
            return 0.0
        if sparse:
            kv = batch * min(context / batch, topk) * per_token + float(context) * index_key
        else:
            kv = float(context) * per_token
        mean = context // batch
        main_pairs = (mean + 1.0 if mean < cap else float(cap)) if sparse else mean + 1.0
        attention = main_pairs * main_per_pair + (mean + 1.0) * index_per_pair
        flops = linear_per_token * batch + batch * attention
        memory_s = (weight_bytes + kv * kv_slowdown) / bandwidth
        compute_s = flops / peak
        return max(memory_s, compute_s) + overhead

    def column(batch: int, context: int, start: int, stop: int, extra: float) -> list[float]:
        """``[step_time_s(batch, context + batch·j) + extra for j in range(start, stop)]``,
        the same arithmetic inlined (``batch`` > 0)."""
        weights, linear = weight_bytes, linear_per_token * batch
        if sparse and not index_key and stop > start and (context + batch * start) // batch >= cap:
            # past the top-k every step reads the same KV (memory time constant; not with the
            # indexer keys, read over the growing context) and compute grows with the
            # context: if the last step is still memory-bound, all are, and every step time
            # is the same float
            kv = batch * min((context + batch * start) / batch, topk) * per_token
            memory_s = (weights + kv * kv_slowdown) / bandwidth
            mean = (context + batch * (stop - 1)) // batch
            attention = float(cap) * main_per_pair + (mean + 1.0) * index_per_pair
            if (linear + batch * attention) / peak <= memory_s:
                return [memory_s + overhead + extra] * (stop - start)
        out = []
        for j in range(start, stop):
            c = context + batch * j
            mean = c // batch
            if sparse:
                kv = batch * min(c / batch, topk) * per_token + float(c) * index_key
                main_pairs = mean + 1.0 if mean < cap else float(cap)
            else:
                kv = float(c) * per_token
                main_pairs = mean + 1.0
            attention = main_pairs * main_per_pair + (mean + 1.0) * index_per_pair
            memory_s = (weights + kv * kv_slowdown) / bandwidth
            compute_s = (linear + batch * attention) / peak
            out.append(max(memory_s, compute_s) + overhead + extra)
        return out

    return step_time_s, column


def _fast_checked(
    model: ModelConfig, hw: HardwareConfig, num_gpus: int
) -> tuple[StepTime, StepColumn] | None:
    """The fast forms, or None when the scalar one differs from the cost model anywhere on
    the check grid (or the column form from the scalar one, bit for bit)."""
    fast, column = _fast(model, hw, num_gpus)
    for b in _CHECK_BATCHES:
        for m in _CHECK_MEAN_CONTEXTS:
            ctx = b * m + b // 2
            ref = cost.decode_step_time_s(model, hw, b, ctx, num_gpus)
            got = fast(b, ctx)
            if abs(got - ref) > _REL_TOL * abs(ref):
                return None
            if column(b, ctx, 1, 4, 0.25) != [fast(b, ctx + b * j) + 0.25 for j in range(1, 4)]:
                return None
    return fast, column


def fast_step_time(model: ModelConfig, hw: HardwareConfig, num_gpus: int) -> StepTime | None:
    """The fast form of ``cost.decode_step_time_s`` for this model, hardware and EP size, or
    None when it differs from the cost model anywhere on the check grid."""
    checked = _fast_checked(model, hw, num_gpus)
    return None if checked is None else checked[0]


def step_time_fn(model: ModelConfig, hw: HardwareConfig, num_gpus: int) -> StepTime:
    """``f(batch, context_tokens)`` equal to ``cost.decode_step_time_s(model, hw, batch,
    context_tokens, num_gpus)``: the fast form when it matches on the check grid, else the
    cost model itself."""
    fast = fast_step_time(model, hw, num_gpus)
    if fast is None:
        return lambda b, c: cost.decode_step_time_s(model, hw, b, c, num_gpus)
    return fast


def step_column_fn(model: ModelConfig, hw: HardwareConfig, num_gpus: int) -> StepColumn:
    """``g(batch, context, start, stop, extra)`` = ``[f(batch, context + batch·j) + extra for
    j in range(start, stop)]`` with ``f = step_time_fn(model, hw, num_gpus)``, bit for bit:
    one call per column of a decode interval (the fast form's arithmetic inlined in a loop)."""
    checked = _fast_checked(model, hw, num_gpus)
    if checked is not None:
        return checked[1]
    f = step_time_fn(model, hw, num_gpus)

    def column(batch: int, context: int, start: int, stop: int, extra: float) -> list[float]:
        return [f(batch, context + batch * j) + extra for j in range(start, stop)]

    return column
