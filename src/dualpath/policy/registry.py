"""Build a policy by name from config (design §11): ``basic``, ``layer``, ``dpl``, ``dualpath``.

Which system runs which policy, and whether a policy prefills layerwise, is the system table
(``dualpath.config.systems``); this module wires each policy's rules.

| name     | PE choice            | DE choice              | read side          | quota | layerwise |
|----------|----------------------|------------------------|--------------------|-------|-----------|
| basic    | round robin / least  | round robin / least    | PE only            | no    | no        |
| layer    | as basic             | as basic               | PE only            | no    | yes       |
| dpl      | round robin / least  | round robin / least    | alternate PE, DE   | no    | yes       |
| dualpath | α/β categories       | groups, R, Z (§7.1)    | shorter read queue | yes   | yes       |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from dualpath.config import Config
from dualpath.config.systems import POLICY_NAMES, SYSTEMS
from dualpath.models import cost
from dualpath.policy.core import PolicyCore
from dualpath.policy.decode import DecodeRule, SimpleDecode
from dualpath.policy.decode_dualpath import DualPathDecode
from dualpath.policy.intra import Predictor
from dualpath.policy.params import PolicyParams, params_from_config
from dualpath.policy.prefill import CategoryPrefill, PrefillRule, RoundRobinPrefill
from dualpath.policy.reuse import AffinityDecode, AffinityPrefill, ReuseRule
from dualpath.policy.side import SideRule

DEFAULT_POLICY = "dualpath"  # where no system names one


def _baseline_prefill(params: PolicyParams, choice: str) -> PrefillRule:
    if choice == "least_loaded":
        return CategoryPrefill(params.alpha_tokens, params.beta_tokens, use_alpha=False)
    return RoundRobinPrefill(params.beta_tokens)


def build_policy(
    name: str,
    params: PolicyParams,
    predict: Predictor,
    engine_choice: str = "round_robin",
    reuse: ReuseRule | None = None,
) -> PolicyCore:
    """Wire the rules of policy ``name`` around ``params`` (no config needed; tests use this).

    ``engine_choice`` ("round_robin" | "least_loaded") applies to the baselines only. The
    baselines never use a compute quota (design §13.7): ``params.compute_quota_s`` is ignored.
    ``reuse``: a reuse design's rule (``policy.reuse``): it decides where hits come from, and
    engines that hold a request's KV are preferred by the PE and DE rules.
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"policy={name!r} is invalid: must be one of {', '.join(POLICY_NAMES)}")
    if engine_choice not in ("round_robin", "least_loaded"):
        raise ValueError(
            f"engine_choice={engine_choice!r} is invalid: must be round_robin or least_loaded"
        )
    if name == "dualpath":
        prefill: PrefillRule = CategoryPrefill(params.alpha_tokens, params.beta_tokens, True)
        decode: DecodeRule = DualPathDecode(params.z_factor)
        side = SideRule(
            "dualpath",
            params.alpha_tokens,
            params.block_tokens,
            params.split_reads,
            params.read_tie_break,
        )
        prefill, decode = _with_affinity(prefill, decode, reuse, params.beta_tokens)
        return PolicyCore(name, params, prefill, decode, side, predict, _layerwise(name), reuse)
    # the intra-engine rules (quota, pass balance) are DualPath's (design §13.7)
    no_quota = replace(params, compute_quota_s=None, pass_balance="quota")
    prefill = _baseline_prefill(params, engine_choice)
    decode = SimpleDecode(engine_choice)
    rule = "round_robin" if name == "dpl" else "pe"
    side = SideRule(rule, params.alpha_tokens, params.block_tokens, split=False)
    prefill, decode = _with_affinity(prefill, decode, reuse, params.beta_tokens)
    return PolicyCore(name, no_quota, prefill, decode, side, predict, _layerwise(name), reuse)


def _with_affinity(
    prefill: PrefillRule, decode: DecodeRule, reuse: ReuseRule | None, beta_tokens: int
) -> tuple[PrefillRule, DecodeRule]:
    if reuse is None:
        return prefill, decode
    return AffinityPrefill(prefill, reuse, beta_tokens), AffinityDecode(decode, reuse)


def _layerwise(policy: str) -> bool:
    return SYSTEMS[policy].layerwise  # each policy is also the system of its own name


def attention_predictor(config: Config) -> Callable[[Sequence[tuple[int, int]]], float]:
    """design §7.2's profiled predictor: the cost model's attention time on one GPU."""
    return cost.attention_time_fn(config.model, config.hardware)


def make_policy(config: Config) -> PolicyCore:
    """The policy named by ``config.scheduler.policy`` (``dualpath`` if unset), α and β
    derived unless given.

    Returns a ``PolicyCore`` (satisfies ``Policy``; also exposes ``alpha_tokens``,
    ``beta_tokens``, ``params``, ``plan_group``)."""
    sched = config.scheduler
    name = sched.policy or DEFAULT_POLICY
    params = params_from_config(config, compute_quota=name == "dualpath")
    r = config.reuse
    reuse = None
    if r.mechanism:
        reuse = ReuseRule(r.mechanism, r.dram_tier_peer_pull, r.peer_source)
    return build_policy(name, params, attention_predictor(config), sched.basic_engine_choice, reuse)
