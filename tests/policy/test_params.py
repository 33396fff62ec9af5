"""α / β derivation (design §13.4), explicit overrides, and the policy registry (design §11)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.config import Config, preset
from dualpath.models import cost
from dualpath.policy import POLICY_NAMES, PolicyParams, build_policy, make_policy
from dualpath.policy.core import PolicyCore
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
    assert prompt == 32_721  # default MAL 64K (design §9)
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


# Every scheduler setting, a valid value other than its default, and the policy it acts in.
# A new ``SchedulerConfig`` field fails ``test_every_scheduler_setting_reaches_the_policy``
# until it is added here, which makes its author show that it reaches the policy.
_CHANGED: dict[str, tuple[object, str]] = {
    "policy": ("basic", "dualpath"),  # (the value, the policy it is compared under)
    "alpha_read_s": (1.5, "dualpath"),
    "beta_prefill_s": (2.5, "dualpath"),
    "alpha_tokens": (123, "dualpath"),
    "beta_tokens": (456, "dualpath"),
    "mean_hit_ratio": (0.5, "dualpath"),
    "compute_quota_s": (0.7, "dualpath"),
    "z_factor": (1.3, "dualpath"),
    "block_tokens": (32, "dualpath"),
    "split_reads": (True, "dualpath"),
    "basic_engine_choice": ("least_loaded", "basic"),
    "read_tie_break": ("pe", "dualpath"),
    "record_decisions": (True, "dualpath"),
    "pass_balance": ("median", "dualpath"),
}


def _wiring(policy: PolicyCore) -> dict[str, object]:
    """What a built policy acts on: its name, its parameters, and every plain setting its
    rules hold (their types and attributes), e.g. the decode rule's Z factor."""
    out: dict[str, object] = {"name": policy.name, "params": policy.params}
    for attr in ("_prefill", "_decode", "_side"):
        rule = getattr(policy, attr)
        plain = {
            k: v
            for k, v in vars(rule).items()
            if isinstance(v, (bool, int, float, str, type(None)))
        }
        out[attr] = (type(rule).__name__, plain)
    return out


def test_every_scheduler_setting_reaches_the_policy() -> None:
    """Each ``scheduler.*`` setting changes the policy every shell builds from the config
    (``make_policy``): one not passed on (e.g. ``z_factor`` left out of ``PolicyParams``) is a
    setting the shells silently ignore."""
    from dataclasses import fields

    from dualpath.config.scheduler import SchedulerConfig

    names = [f.name for f in fields(SchedulerConfig)]
    assert sorted(names) == sorted(_CHANGED), "add each new scheduler setting to _CHANGED"
    base = preset("ds660b-2p4d")
    ignored = []
    for name in names:
        value, policy = _CHANGED[name]
        assert getattr(base.scheduler, name) != value
        before = _wiring(make_policy(with_sched(base, policy=policy)))
        after = _wiring(make_policy(with_sched(base, **{"policy": policy, name: value})))
        if after == before:
            ignored.append(name)
    assert not ignored, f"settings that do not reach the policy: {ignored}"
