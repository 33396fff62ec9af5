"""Host profiling: real timings of the engines' data path, usable by the calibration."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from dualpath.config import preset
from dualpath.models.calibrate import calibrated_hardware, fit
from dualpath.runtime.profile import profile_host

pytestmark = pytest.mark.runtime


def test_profile_gives_positive_timings_in_the_calibration_format() -> None:
    cfg = preset("tiny-1p1d")
    prof = profile_host(
        cfg.model,
        cfg.scheduler.block_tokens,
        prefill_grid=((0, 32, 1), (64, 32, 1), (0, 128, 1), (64, 16, 3)),
        decode_grid=((64, 1), (256, 1), (128, 3)),
        repeats=1,
    )
    assert [(s.cached_tokens, s.new_tokens, s.batch) for s in prof.prefill] == [
        (0, 32, 1),
        (64, 32, 1),
        (0, 128, 1),
        (64, 16, 3),
    ]
    assert [(s.context_tokens, s.batch) for s in prof.decode] == [(64, 1), (256, 1), (128, 3)]
    assert all(s.seconds > 0 for s in prof.prefill + prof.decode)  # type: ignore[operator]
    # a measured rate (its size is this host's: benchmarks/bench_host.py reports it)
    assert math.isfinite(prof.memory_bytes_per_s) and prof.memory_bytes_per_s > 0
    # the samples are the calibration's input: it fits them, or (one pass each, on a loaded
    # host: the timings are noise) refuses them in one line; whether this host's timings fit
    # is benchmarks/bench_host.py's to report, not a unit test's
    try:
        f = fit(cfg.model, prof.prefill, prof.decode, prof.memory_bytes_per_s)
        hw = calibrated_hardware(cfg.hardware, cfg.model, f)
    except ValueError as err:  # the fit, or the hardware from it (e.g. no growth with context)
        assert "too small" in str(err) and "\n" not in str(err), err
        return
    assert 0 < hw.kv_read_efficiency <= 1 and hw.gpu_bf16_flops > 0
