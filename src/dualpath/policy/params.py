"""Numeric parameters of the policy core (α, β, quota, Z factor) and their derivation (design §13.4).

Pure: derives tokens from hardware and model through ``dualpath.models.cost``; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import Config
from dualpath.models import cost

# design §9: average agent context per maximum agent context length; β's "typical prompt".
MEAN_CONTEXT_TOKENS_BY_MAL: dict[str, int] = {"32k": 17_183, "48k": 25_120, "64k": 32_721}


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Resolved scheduler parameters, all in tokens or seconds.

    ``alpha_tokens`` (α): a node's read queue at or below this is "short" (PE category 2).
    ``beta_tokens`` (β): a PE whose unfinished prompt tokens exceed this is overloaded.
    ``compute_quota_s``: predicted attention time allowed per PE forward pass (None = no quota).
    ``typical_prompt_tokens``: the prompt length β was derived at (0 when β was given).
    ``pass_balance``: "quota" (design §7.2) or "median" (each pass of an EP group capped at the
    median predicted attention of its PEs with work, never below ``balance_floor_s``).
    """

    alpha_tokens: int
    beta_tokens: int
    compute_quota_s: float | None = 0.3
    z_factor: float = 1.05
    block_tokens: int = 64
    split_reads: bool = False
    record_decisions: bool = False
    typical_prompt_tokens: int = 0
    read_tie_break: str = "least_read"
    pass_balance: str = "quota"
    balance_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha_tokens < 0:
            raise ValueError(f"alpha_tokens={self.alpha_tokens} is invalid: must be >= 0")
        if self.beta_tokens < 1:
            raise ValueError(f"beta_tokens={self.beta_tokens} is invalid: must be >= 1")
        if self.compute_quota_s is not None and not self.compute_quota_s > 0:
            raise ValueError(
                f"compute_quota_s={self.compute_quota_s} is invalid: must be > 0 or None"
            )
        if not self.z_factor >= 1.0:
            raise ValueError(f"z_factor={self.z_factor} is invalid: must be >= 1.0")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens={self.block_tokens} is invalid: must be >= 1")
        if self.read_tie_break not in ("pe", "least_read"):
            raise ValueError(
                f"read_tie_break={self.read_tie_break!r} is invalid: must be 'pe' or 'least_read'"
            )
        if self.pass_balance not in ("quota", "median"):
            raise ValueError(
                f"pass_balance={self.pass_balance!r} is invalid: must be 'quota' or 'median'"
            )
        if not self.balance_floor_s >= 0.0:
            raise ValueError(f"balance_floor_s={self.balance_floor_s} is invalid: must be >= 0")
        if self.typical_prompt_tokens < 0:
            raise ValueError(
                f"typical_prompt_tokens={self.typical_prompt_tokens} is invalid: must be >= 0"
            )


def typical_prompt_tokens(config: Config) -> int:
    """The prompt β is derived at: the mean context of the workload's MAL (design §9), capped by
    the model's maximum context."""
    mean = MEAN_CONTEXT_TOKENS_BY_MAL[config.workload.mal.lower()]
    return max(1, min(mean, config.model.max_context_tokens))


def derive_alpha_tokens(config: Config) -> int:
    """α = tokens one node's storage NICs read in ``alpha_read_s`` (design §13.4)."""
    per_token = cost.kv_bytes_per_token(config.model)
    read_bytes = config.hardware.snic_total_bytes_per_s * config.scheduler.alpha_read_s
    return int(read_bytes // per_token)


def derive_beta_tokens(config: Config, prompt_tokens: int) -> int:
    """β = prompt tokens one PE GPU prefills in ``beta_prefill_s`` at the mean hit ratio."""
    rate = cost.prefill_tokens_per_s(
        config.model, config.hardware, prompt_tokens, config.scheduler.mean_hit_ratio
    )
    return max(1, int(rate * config.scheduler.beta_prefill_s))


def params_from_config(config: Config, *, compute_quota: bool = True) -> PolicyParams:
    """Resolve α and β (derived unless ``alpha_tokens`` / ``beta_tokens`` are set, 0 = derive)."""
    sched = config.scheduler
    alpha = sched.alpha_tokens or derive_alpha_tokens(config)
    prompt = 0 if sched.beta_tokens else typical_prompt_tokens(config)
    beta = sched.beta_tokens or derive_beta_tokens(config, prompt)
    return PolicyParams(
        alpha_tokens=alpha,
        beta_tokens=beta,
        compute_quota_s=sched.compute_quota_s if compute_quota else None,
        z_factor=sched.z_factor,
        block_tokens=sched.block_tokens,
        split_reads=sched.split_reads,
        record_decisions=sched.record_decisions,
        typical_prompt_tokens=prompt,
        read_tie_break=sched.read_tie_break,
        pass_balance=sched.pass_balance,
        balance_floor_s=pass_overhead_s(config),
    )


def pass_overhead_s(config: Config) -> float:
    """A prefill pass's token-independent overheads (per pass + per layer; no EP latency,
    which depends on the group): the floor of a ``pass_balance="median"`` cap, below which a
    capped pass would spend more on overheads than the attention it defers."""
    hw = config.hardware
    return hw.prefill_pass_overhead_s + hw.prefill_layer_overhead_s * config.model.num_layers
