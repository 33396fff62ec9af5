"""Calibration: fitted constants reproduce the samples they came from."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath.config import preset
from dualpath.models import cost
from dualpath.models.calibrate import (
    DecodeSample,
    PrefillSample,
    calibrated_hardware,
    fit,
    nnls_relative,
    predicted_decode_s,
    predicted_prefill_s,
)

CFG = preset("tiny-1p1d")
GRID = ((0, 64, 1), (0, 512, 1), (1024, 128, 1), (2048, 64, 1), (2048, 256, 1), (1024, 64, 4))
DECODE = ((256, 1), (1024, 1), (4096, 1), (1024, 4), (2048, 8))
COPY = 10e9  # a host whose memory copies move 10 GB/s


def _truth() -> object:
    # GEMMs at 20 GFLOP/s, attention 8 GFLOP/s, 3 ms per pass; decode: 1 ms per step, weights
    # at the copy rate, KV at 5% of it (0.5 GB/s)
    return dataclasses.replace(
        CFG.hardware,
        gpu_bf16_flops=20e9,
        gpu_fp8_flops=20e9,
        linear_mfu=1.0,
        attention_mfu=0.4,
        hbm_bytes_per_s=COPY,
        hbm_efficiency=1.0,
        kv_read_efficiency=0.05,
        decode_step_overhead_s=1e-3,
        prefill_pass_overhead_s=3e-3,
        prefill_layer_overhead_s=0.0,
    )


def _samples(hw):  # type: ignore[no-untyped-def]
    m = CFG.model
    pre = [PrefillSample(c, n, 0.0, b) for c, n, b in GRID]
    pre = [dataclasses.replace(s, seconds=predicted_prefill_s(m, hw, s)) for s in pre]
    dec = [DecodeSample(c, 0.0, b) for c, b in DECODE]
    dec = [dataclasses.replace(s, seconds=predicted_decode_s(m, hw, s)) for s in dec]
    return pre, dec


def test_fit_recovers_known_hardware() -> None:
    truth = _truth()
    pre, dec = _samples(truth)
    f = fit(CFG.model, pre, dec, COPY)
    assert f.linear_flops_per_s == pytest.approx(20e9, rel=1e-6)
    assert f.attention_flops_per_s == pytest.approx(8e9, rel=1e-6)
    assert f.prefill_overhead_s == pytest.approx(3e-3, rel=1e-6)
    assert f.kv_bytes_per_s == pytest.approx(0.5e9, rel=1e-6)
    assert f.decode_overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert f.prefill_max_rel_err < 1e-9 and f.decode_max_rel_err < 1e-9
    hw = calibrated_hardware(CFG.hardware, CFG.model, f)
    assert hw.kv_read_efficiency == pytest.approx(0.05, rel=1e-6)
    for s in pre:  # the calibrated preset predicts every sample as the simulator charges it
        assert predicted_prefill_s(CFG.model, hw, s) == pytest.approx(s.seconds, rel=1e-6)
    for s in dec:
        assert predicted_decode_s(CFG.model, hw, s) == pytest.approx(s.seconds, rel=1e-6)
    assert hw.snic_bytes_per_s == CFG.hardware.snic_bytes_per_s  # NIC rates are kept


def test_decode_batches_are_charged_by_their_total_context() -> None:
    # a batch of 4 at 1024 reads the KV of 4096 tokens once: its step equals one sequence's
    # at 4096 plus the per-sequence compute, which is negligible at these rates
    hw = _truth()
    one = predicted_decode_s(CFG.model, hw, DecodeSample(4096, 0.0, 1))
    four = predicted_decode_s(CFG.model, hw, DecodeSample(1024, 0.0, 4))
    assert four == pytest.approx(one, rel=0.01)
    kv_s = 4096 * cost.kv_bytes_per_token(CFG.model) / 0.5e9
    weights_s = cost.weight_bytes_per_gpu(CFG.model, 1) / COPY
    assert one == pytest.approx(1e-3 + weights_s + kv_s, rel=1e-9)  # by hand


def test_nnls_keeps_coefficients_non_negative() -> None:
    # y = 2·x, with a constant column the data pulls negative: the constant is dropped
    xs = [1.0, 2.0, 3.0]
    ys = [1.9, 4.0, 6.1]
    c = nnls_relative(([1.0] * 3, xs), ys)
    assert c[0] == 0.0 and c[1] == pytest.approx(2.0, rel=0.05)
    # an exact affine truth is recovered
    c = nnls_relative(([1.0] * 3, xs), [0.5 + 2 * x for x in xs])
    assert c == pytest.approx([0.5, 2.0], rel=1e-9)


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError, match="at least three"):
        fit(CFG.model, [PrefillSample(0, 64, 0.01)], [DecodeSample(1, 0.01)], COPY)
    pre, dec = _samples(_truth())
    with pytest.raises(ValueError, match="memory_bytes_per_s"):
        fit(CFG.model, pre, dec, 0.0)
