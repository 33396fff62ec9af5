"""Fit the cost model's hardware constants to step times measured on a real host.

Pure: takes measurements (from ``dualpath.runtime.profile``), returns a ``HardwareConfig``
whose predictions reproduce them, in the same forms the simulator evaluates:

- a prefill pass of ``batch`` chunks of (cached, new) tokens on one GPU:
  ``t = overhead + linear_flops / F_lin + attention_flops / F_attn``
  (``cost.prefill_fixed_s + prefill_linear_time_s + attention_time_s``);
- a decode step of ``batch`` sequences of ``context`` tokens:
  ``t = overhead + weight_bytes / W + kv_bytes / K``
  (``cost.decode_step_time_s``): the weights read at the host's memory bandwidth ``W``
  (measured by a copy), the KV read at the rate ``K`` the attention path reaches, which on a
  CPU host is far below ``W`` (pages gathered, padded and repeated per head).

Both are fitted by non-negative least squares on *relative* error (every sample counts the
same whatever its size).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.models import cost


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One prefill pass: ``batch`` chunks, each ``new_tokens`` after ``cached_tokens``."""

    cached_tokens: int
    new_tokens: int
    seconds: float
    batch: int = 1

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return [(self.cached_tokens, self.new_tokens)] * self.batch


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decode step of ``batch`` sequences, each attending ``context_tokens``."""

    context_tokens: int
    seconds: float
    batch: int = 1


@dataclass(frozen=True, slots=True)
class Fit:
    """The fitted constants and how well they reproduce the samples (max relative error)."""

    linear_flops_per_s: float
    attention_flops_per_s: float
    prefill_overhead_s: float
    weight_bytes_per_s: float  # the host's memory bandwidth (measured, not fitted)
    kv_bytes_per_s: float
    decode_overhead_s: float
    prefill_max_rel_err: float
    decode_max_rel_err: float


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls_relative(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """min Σ ((Σ_j c_j·x_ij − y_i) / y_i)² subject to c ≥ 0, by trying every active set
    (a handful of columns: exact, no iteration)."""
    k = len(columns)
    rows = [[col[i] / y for col in columns] for i, y in enumerate(ys)]  # scaled: target 1

    def sse(c: list[float]) -> float:
        return sum((sum(cj * xj for cj, xj in zip(c, r, strict=True)) - 1.0) ** 2 for r in rows)

    best: list[float] = [0.0] * k
    best_sse = sse(best)
    for size in range(1, k + 1):
        for active in itertools.combinations(range(k), size):
            a = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
            b = [sum(r[i] for r in rows) for i in active]
            sol = _solve(a, b)
            if sol is None or min(sol) < 0:
                continue
            c = [0.0] * k
            for i, v in zip(active, sol, strict=True):
                c[i] = v
            if (e := sse(c)) < best_sse:
                best, best_sse = c, e
    return best


def _max_rel_err(
    columns: Sequence[Sequence[float]], c: Sequence[float], ys: Sequence[float]
) -> float:
    return max(
        abs(sum(cj * col[i] for cj, col in zip(c, columns, strict=True)) - y) / y
        for i, y in enumerate(ys)
    )


def fit(
    model: ModelConfig,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    memory_bytes_per_s: float,
) -> Fit:
    """Prefill FLOP rates and pass overhead; decode KV read rate and step overhead, with the
    weights read at ``memory_bytes_per_s`` (the host's measured copy bandwidth)."""
    if len(prefill) < 3 or len(decode) < 2:
        raise ValueError("calibration needs at least three prefill and two decode samples")
    if not memory_bytes_per_s > 0:
        raise ValueError(f"memory_bytes_per_s={memory_bytes_per_s} is invalid: must be > 0")
    ones = [1.0] * len(prefill)
    lin = [cost.linear_flops(model, s.new_tokens * s.batch) for s in prefill]
    att = [sum(cost.attention_flops(model, c, n) for c, n in s.pairs) for s in prefill]
    pre_y = [s.seconds for s in prefill]
    pre_cols = (ones, lin, att)
    c0, a, b = nnls_relative(pre_cols, pre_y)

    weights_s = cost.weight_bytes_per_gpu(model, 1) / memory_bytes_per_s
    per_token = cost.kv_bytes_per_token(model)
    dec_ones = [1.0] * len(decode)
    kv = [float(s.batch * s.context_tokens * per_token) for s in decode]
    dec_y = [s.seconds for s in decode]
    d0, d1 = nnls_relative((dec_ones, kv), dec_y)
    return Fit(
        linear_flops_per_s=1.0 / a if a > 0 else float("inf"),
        attention_flops_per_s=1.0 / b if b > 0 else float("inf"),
        prefill_overhead_s=c0,
        weight_bytes_per_s=memory_bytes_per_s,
        kv_bytes_per_s=1.0 / d1 if d1 > 0 else float("inf"),
        decode_overhead_s=max(0.0, d0 - weights_s),
        prefill_max_rel_err=_max_rel_err(pre_cols, (c0, a, b), pre_y),
        decode_max_rel_err=_max_rel_err((dec_ones, kv), (max(d0, weights_s), d1), dec_y),
    )


def calibrated_hardware(base: HardwareConfig, model: ModelConfig, f: Fit) -> HardwareConfig:
    """``base`` (NIC rates, buffers, HBM size kept) with compute and memory constants from ``f``.

    The peak is the faster of the two fitted FLOP rates; each kernel class gets its MFU
    relative to it. "HBM" is the host's memory: its bandwidth is the measured copy rate
    (efficiency 1) and decode attention reads KV at ``kv_read_efficiency`` of it. The pass
    overhead is per pass (no per-layer term: the fit cannot tell them apart).
    """
    finite = [x for x in (f.linear_flops_per_s, f.attention_flops_per_s) if x != float("inf")]
    if not finite:
        raise ValueError("calibration found no prefill compute time: measurements too small")
    if f.kv_bytes_per_s == float("inf"):
        raise ValueError("calibration found no decode time growing with context: too small")
    peak = max(finite)
    return replace(
        base,
        name=f"{base.name}-calibrated",
        gpu_bf16_flops=peak,
        gpu_fp8_flops=peak,
        linear_mfu=min(1.0, f.linear_flops_per_s / peak),
        attention_mfu=min(1.0, f.attention_flops_per_s / peak),
        hbm_bytes_per_s=f.weight_bytes_per_s,
        hbm_efficiency=1.0,
        kv_read_efficiency=min(1.0, f.kv_bytes_per_s / f.weight_bytes_per_s),
        decode_step_overhead_s=f.decode_overhead_s,
        prefill_pass_overhead_s=f.prefill_overhead_s,
        prefill_layer_overhead_s=0.0,
    )


def predicted_prefill_s(model: ModelConfig, hw: HardwareConfig, s: PrefillSample) -> float:
    """What the simulator charges one GPU's pass of ``s`` (no EP group): fixed + GEMMs +
    attention."""
    return (
        cost.prefill_fixed_s(model, hw, 1)
        + cost.prefill_linear_time_s(model, hw, s.new_tokens * s.batch)
        + cost.attention_time_s(model, hw, s.pairs)
    )


def predicted_decode_s(model: ModelConfig, hw: HardwareConfig, s: DecodeSample) -> float:
    """What the simulator charges one decode step of ``s``."""
    return cost.decode_step_time_s(model, hw, s.batch, s.batch * s.context_tokens)
