"""The whole resolved configuration of one run."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.config.cluster import ClusterConfig
from dualpath.config.hardware import HardwareConfig
from dualpath.config.model import ModelConfig
from dualpath.config.scheduler import SchedulerConfig
from dualpath.config.sim import SimConfig
from dualpath.config.workload import WorkloadConfig


@dataclass(frozen=True, slots=True)
class Config:
    name: str = "ds660b-2p4d"
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    sim: SimConfig = field(default_factory=SimConfig)
