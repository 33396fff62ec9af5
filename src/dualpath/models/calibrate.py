"""Fit the cost model's hardware constants to step times measured on a real host.

Pure: takes measurements (from ``dualpath.runtime.profile``), returns a ``HardwareConfig``
whose predictions (``cost.prefill_time_s``, ``cost.decode_step_time_s``) reproduce them.
Prefill: ``t = linear_flops / F_lin + attention_flops / F_attn`` fitted by least squares
through the origin (a per-forward intercept is reported, not modelled, when the cost model
has no term for it). Decode: ``t = overhead + bytes / bandwidth`` (a straight line in the
bytes one step reads: weights + the context's KV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.models import cost


@dataclass(frozen=True, slots=True)
class PrefillSample:
    cached_tokens: int
    new_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Fit:
    """The fitted constants and how well they reproduce the samples (max relative error)."""

    linear_flops_per_s: float
    attention_flops_per_s: float
    hbm_bytes_per_s: float
    decode_overhead_s: float
    prefill_max_rel_err: float
    decode_max_rel_err: float


def _lstsq2(xs: Sequence[tuple[float, float]], ys: Sequence[float]) -> tuple[float, float]:
    """min Σ (a·x0 + b·x1 − y)² with a, b ≥ 0 (normal equations; one-variable fallback)."""
    s00 = sum(x0 * x0 for x0, _ in xs)
    s01 = sum(x0 * x1 for x0, x1 in xs)
    s11 = sum(x1 * x1 for _, x1 in xs)
    t0 = sum(x0 * y for (x0, _), y in zip(xs, ys, strict=True))
    t1 = sum(x1 * y for (_, x1), y in zip(xs, ys, strict=True))
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        a = (t0 * s11 - t1 * s01) / det
        b = (t1 * s00 - t0 * s01) / det
        if a > 0 and b > 0:
            return a, b
    # a boundary solution: one variable carries everything
    only_a = (t0 / s00, 0.0) if s00 > 0 else (0.0, 0.0)
    only_b = (0.0, t1 / s11) if s11 > 0 else (0.0, 0.0)

    def sse(ab: tuple[float, float]) -> float:
        return sum((ab[0] * x0 + ab[1] * x1 - y) ** 2 for (x0, x1), y in zip(xs, ys, strict=True))

    return min((only_a, only_b), key=sse)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; intercept clamped at ≥ 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept < 0 or slope <= 0:
        slope = max(sum(ys) / sum(xs), 1e-30) if sum(xs) else 1e-30
        intercept = 0.0
    return intercept, slope


def fit(
    model: ModelConfig,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
) -> Fit:
    """Effective FLOP/s for GEMMs and attention, decode bandwidth and per-step overhead."""
    if len(prefill) < 2 or len(decode) < 2:
        raise ValueError("calibration needs at least two prefill and two decode samples")
    xs = [
        (
            cost.linear_flops(model, s.new_tokens),
            cost.attention_flops(model, s.cached_tokens, s.new_tokens),
        )
        for s in prefill
    ]
    a, b = _lstsq2(xs, [s.seconds for s in prefill])
    lin = 1.0 / a if a > 0 else float("inf")
    att = 1.0 / b if b > 0 else float("inf")
    weights = cost.weight_bytes_per_gpu(model, 1)
    per_token = cost.kv_bytes_per_token(model)
    dx = [weights + s.context_tokens * per_token for s in decode]
    overhead, slope = _line(dx, [s.seconds for s in decode])
    pre_err = max(
        abs((x0 * a + x1 * b) - s.seconds) / s.seconds
        for (x0, x1), s in zip(xs, prefill, strict=True)
    )
    dec_err = max(
        abs(overhead + x * slope - s.seconds) / s.seconds for x, s in zip(dx, decode, strict=True)
    )
    return Fit(lin, att, 1.0 / slope, overhead, pre_err, dec_err)


def calibrated_hardware(base: HardwareConfig, model: ModelConfig, f: Fit) -> HardwareConfig:
    """``base`` (NIC rates, buffers, HBM size kept) with compute and memory constants from ``f``.

    The peak is the faster of the two fitted FLOP rates; each kernel class gets its MFU
    relative to it, so ``cost.prefill_time_s`` reproduces the fit exactly. Decode: the
    roofline's memory term is the fitted line (efficiency 1).
    """
    finite = [x for x in (f.linear_flops_per_s, f.attention_flops_per_s) if x != float("inf")]
    if not finite:
        raise ValueError("calibration found no prefill compute time: measurements too small")
    peak = max(finite)
    lin_mfu = min(1.0, f.linear_flops_per_s / peak)
    att_mfu = min(1.0, f.attention_flops_per_s / peak)
    return replace(
        base,
        name=f"{base.name}-calibrated",
        gpu_bf16_flops=peak,
        gpu_fp8_flops=peak,
        linear_mfu=lin_mfu,
        attention_mfu=att_mfu,
        hbm_bytes_per_s=f.hbm_bytes_per_s,
        hbm_efficiency=1.0,
        decode_step_overhead_s=f.decode_overhead_s,
    )
