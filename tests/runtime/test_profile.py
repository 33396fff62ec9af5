"""Host profiling: real timings of the runtime model, usable by the calibration."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from dualpath.config import preset
from dualpath.models.calibrate import fit
from dualpath.runtime.profile import profile_model

pytestmark = pytest.mark.runtime


def test_profile_gives_positive_timings_the_fit_accepts() -> None:
    model = preset("tiny-1p1d").model
    pre, dec = profile_model(
        model, prefill_grid=((0, 32), (64, 32), (0, 128)), decode_contexts=(64, 256), repeats=1
    )
    assert [(s.cached_tokens, s.new_tokens) for s in pre] == [(0, 32), (64, 32), (0, 128)]
    assert all(s.seconds > 0 for s in pre + dec)  # type: ignore[operator]
    f = fit(model, pre, dec)
    assert f.linear_flops_per_s > 0 and f.hbm_bytes_per_s > 0
