"""α / β derivation (SPEC §13.4), explicit overrides, and the policy registry (SPEC §11)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.config import Config, preset
from dualpath.models import cost
from dualpath.policy import POLICY_NAMES, PolicyParams, build_policy, make_policy
from dualpath.policy.params import typical_prompt_tokens


def with_sched(config: Config, **kw: object) -> Config:
    return replace(config, scheduler=replace(config.scheduler, **kw))


def test_alpha_is_tokens_the_node_reads_in_3s() -> None:
    c = preset("ds660b-2p4d")
    p = make_policy(c)
    expected = int(c.hardware.snic_total_bytes_per_s * 3.0 // cost.kv_bytes_per_token(c.model))
    assert p.alpha_tokens == expected  # type: ignore[attr-defined]
    assert 3_000_000 < expected < 4_500_000  # 50 GB/s · 3 s / 40 KB


def test_beta_is_tokens_one_gpu_prefills_in_5s() -> None:
    c = preset("ds27b-1p1d")
    prompt = typical_prompt_tokens(c)
    assert prompt == 32_721  # default MAL 64K (SPEC §9)
    rate = cost.prefill_tokens_per_s(c.model, c.hardware, prompt, 0.987)
    assert make_policy(c).beta_tokens == int(rate * 5.0)  # type: ignore[attr-defined]


def test_explicit_alpha_beta_win() -> None:
    c = with_sched(preset(), alpha_tokens=123, beta_tokens=456)
    p = make_policy(c)
    assert (p.alpha_tokens, p.beta_tokens) == (123, 456)  # type: ignore[attr-defined]
    assert p.params.typical_prompt_tokens == 0  # type: ignore[attr-defined]


def test_typical_prompt_capped_by_model_context() -> None:
    assert typical_prompt_tokens(preset("tiny-1p1d")) == 16_384


@pytest.mark.parametrize(
    ("name", "quota", "layerwise"),
    [("basic", None, False), ("dpl", None, True), ("dualpath", 0.3, True)],
)
def test_registry_by_config_name(name: str, quota: float | None, layerwise: bool) -> None:
    p = make_policy(with_sched(preset(), policy=name))
    assert p.name == name
    assert p.layerwise is layerwise
    assert p.params.compute_quota_s == quota  # type: ignore[attr-defined]


def test_layer_variant_and_unknown_name() -> None:
    assert "layer" in POLICY_NAMES
    p = build_policy("layer", PolicyParams(10, 10), lambda pairs: 0.0)
    assert p.layerwise and p.params.compute_quota_s is None
    with pytest.raises(ValueError, match="policy='fifo' is invalid"):
        build_policy("fifo", PolicyParams(10, 10), lambda pairs: 0.0)
    with pytest.raises(ValueError, match="engine_choice"):
        build_policy("basic", PolicyParams(10, 10), lambda pairs: 0.0, "random")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"alpha_tokens": -1}, "alpha_tokens=-1"),
        ({"beta_tokens": 0}, "beta_tokens=0"),
        ({"compute_quota_s": 0.0}, "compute_quota_s=0.0"),
        ({"z_factor": 0.9}, "z_factor=0.9"),
        ({"block_tokens": 0}, "block_tokens=0"),
    ],
)
def test_params_out_of_range(kw: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"alpha_tokens": 1, "beta_tokens": 1}
    with pytest.raises(ValueError, match=match):
        PolicyParams(**{**base, **kw})  # type: ignore[arg-type]
