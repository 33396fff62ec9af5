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
)

CFG = preset("tiny-1p1d")
GRID = ((0, 64), (0, 512), (1024, 128), (2048, 64), (2048, 256))


def _samples(hw):  # type: ignore[no-untyped-def]
    m = CFG.model
    pre = [PrefillSample(c, n, cost.prefill_time_s(m, hw, [(c, n)])) for c, n in GRID]
    dec = [DecodeSample(c, cost.decode_step_time_s(m, hw, 1, c)) for c in (256, 1024, 4096)]
    return pre, dec


def test_fit_recovers_known_hardware() -> None:
    # a host whose GEMMs reach 20 GFLOP/s, attention 8 GFLOP/s, decode reads at 2 GB/s + 1 ms
    truth = dataclasses.replace(
        CFG.hardware,
        gpu_bf16_flops=20e9,
        gpu_fp8_flops=20e9,
        linear_mfu=1.0,
        attention_mfu=0.4,
        hbm_bytes_per_s=2e9,
        hbm_efficiency=1.0,
        decode_step_overhead_s=1e-3,
    )
    pre, dec = _samples(truth)
    f = fit(CFG.model, pre, dec)
    assert f.linear_flops_per_s == pytest.approx(20e9, rel=1e-6)
    assert f.attention_flops_per_s == pytest.approx(8e9, rel=1e-6)
    assert f.hbm_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert f.decode_overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert f.prefill_max_rel_err < 1e-9 and f.decode_max_rel_err < 1e-9
    hw = calibrated_hardware(CFG.hardware, CFG.model, f)
    for s in pre:  # the calibrated preset predicts every sample
        got = cost.prefill_time_s(CFG.model, hw, [(s.cached_tokens, s.new_tokens)])
        assert got == pytest.approx(s.seconds, rel=1e-6)
    for s in dec:
        assert cost.decode_step_time_s(CFG.model, hw, 1, s.context_tokens) == pytest.approx(
            s.seconds, rel=1e-6
        )
    assert hw.snic_bytes_per_s == CFG.hardware.snic_bytes_per_s  # NIC rates are kept


def test_fit_needs_samples() -> None:
    with pytest.raises(ValueError, match="at least two"):
        fit(CFG.model, [PrefillSample(0, 64, 0.01)], [DecodeSample(1, 0.01)])
