"""Scheduler parameters (design §7, §13.3–4)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import one_of, positive, require
from dualpath.config.systems import POLICY_NAMES

ENGINE_CHOICES = ("round_robin", "least_loaded")
READ_TIE_BREAKS = ("pe", "least_read")
PASS_BALANCES = ("quota", "median")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """α and β are given as seconds of work and converted to tokens from hardware and model,
    unless ``alpha_tokens`` / ``beta_tokens`` are set (0 = derive).

    ``policy``: "" (default) takes the policy of the system being run (``config.systems``;
    ``dualpath`` where no system is named); a policy set here must match that system's."""

    policy: str = ""
    alpha_read_s: float = 3.0  # α: tokens the node's SNIC reads in this many seconds
    beta_prefill_s: float = 5.0  # β: tokens one PE GPU prefills in this many seconds
    alpha_tokens: int = 0  # explicit α (0 = derive from alpha_read_s)
    beta_tokens: int = 0  # explicit β (0 = derive from beta_prefill_s)
    mean_hit_ratio: float = 0.987  # hit ratio at which β is derived (design §13.4)
    compute_quota_s: float = 0.3  # predicted attention time per PE forward pass
    z_factor: float = 1.05  # Z = z_factor × mean DE tokens (design §7.1)
    block_tokens: int = 64
    split_reads: bool = False  # beyond the paper: read one request from both sides
    basic_engine_choice: str = "round_robin"  # Basic / DPL engine choice
    # beyond the paper: equal read queues go to the PE node ("pe"), or to the node whose
    # storage NICs have read fewer bytes so far ("least_read")
    read_tie_break: str = "least_read"
    record_decisions: bool = False  # keep a decision trace (JSONL-able)
    # beyond the paper: "quota" packs each PE of an EP group to the compute quota (design §7.2);
    # "median" then caps every PE of the pass at the median predicted attention time of the
    # PEs with work (never below a pass's fixed overheads): docs/policy.md, "Pass balance"
    pass_balance: str = "quota"

    def __post_init__(self) -> None:
        one_of("scheduler.policy", self.policy, ("", *POLICY_NAMES))
        one_of("scheduler.basic_engine_choice", self.basic_engine_choice, ENGINE_CHOICES)
        one_of("scheduler.read_tie_break", self.read_tie_break, READ_TIE_BREAKS)
        one_of("scheduler.pass_balance", self.pass_balance, PASS_BALANCES)
        positive("scheduler.alpha_read_s", self.alpha_read_s)
        positive("scheduler.beta_prefill_s", self.beta_prefill_s)
        require(self.alpha_tokens >= 0, "scheduler.alpha_tokens", self.alpha_tokens, ">= 0")
        require(self.beta_tokens >= 0, "scheduler.beta_tokens", self.beta_tokens, ">= 0")
        require(
            0 <= self.mean_hit_ratio < 1,
            "scheduler.mean_hit_ratio",
            self.mean_hit_ratio,
            "in [0, 1)",
        )
        positive("scheduler.compute_quota_s", self.compute_quota_s)
        require(self.z_factor >= 1.0, "scheduler.z_factor", self.z_factor, ">= 1.0")
        require(
            isinstance(self.block_tokens, int) and self.block_tokens >= 1,
            "scheduler.block_tokens",
            self.block_tokens,
            "an integer >= 1",
        )
