"""Workload: synthetic agentic trajectories (design §9) or a Mooncake trace; offline or online."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import non_negative, one_of, positive, require

MAL_NAMES = ("32k", "48k", "64k")
MODES = ("offline", "online")
# "table2": design §9's five columns as per-trajectory means (default); "per_turn": the
# earlier form (turns, total, turn-weighted context; append:gen imposed per turn).
SYNTH_FORMS = ("table2", "per_turn")


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    mal: str = "64k"  # maximum agent context length: which trace statistics to synthesise
    num_agents: int = 64
    num_base_trajectories: int = 500
    mode: str = "offline"
    aps: float = 0.0  # online: agents per second (Poisson arrivals)
    trace: str = ""  # path to a Mooncake-format JSONL trace ("" = synthesise)
    trace_speedup: float = 1.0  # replay a trace this many times faster
    seed: int = 0
    synth: str = "table2"  # synthesiser form, one of SYNTH_FORMS (docs/workload.md)
    # a workload of one's own (docs/workload.md, "Custom workloads"; workload/custom.py):
    trajectories: str = ""  # JSONL of trajectories (agents beyond the file replicate it)
    distributions: str = ""  # TOML of turn count / first append / append / generation

    def __post_init__(self) -> None:
        one_of("workload.mal", self.mal.lower(), MAL_NAMES)
        one_of("workload.mode", self.mode, MODES)
        one_of("workload.synth", self.synth, SYNTH_FORMS)
        require(
            isinstance(self.num_agents, int) and self.num_agents >= 1,
            "workload.num_agents",
            self.num_agents,
            "an integer >= 1",
        )
        require(
            isinstance(self.num_base_trajectories, int) and self.num_base_trajectories >= 1,
            "workload.num_base_trajectories",
            self.num_base_trajectories,
            "an integer >= 1",
        )
        require(
            not (self.trajectories and self.distributions),
            "workload.trajectories",
            self.trajectories,
            "empty when workload.distributions is set (one source of trajectories)",
        )
        non_negative("workload.aps", self.aps)
        positive("workload.trace_speedup", self.trace_speedup)
        require(
            isinstance(self.seed, int) and self.seed >= 0,
            "workload.seed",
            self.seed,
            "an integer >= 0",
        )
