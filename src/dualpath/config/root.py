"""The whole resolved configuration of one run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dualpath.config.cluster import ClusterConfig
from dualpath.config.hardware import HardwareConfig
from dualpath.config.model import ModelConfig
from dualpath.config.reuse import ReuseConfig
from dualpath.config.scheduler import SchedulerConfig
from dualpath.config.sim import SimConfig
from dualpath.config.systems import SystemSpec
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
    reuse: ReuseConfig = field(default_factory=ReuseConfig)

    if TYPE_CHECKING:  # bound in dualpath/config/__init__.py (see there why)

        @classmethod
        def from_preset(cls, name: str, overrides: Iterable[str] = ()) -> Config: ...

        def with_overrides(self, *overrides: str) -> Config: ...


def config_for(config: Config, spec: SystemSpec) -> Config:
    """``config`` with the system's policy and reuse mechanism selected (nothing else changes).

    ``scheduler.policy`` / ``reuse.mechanism`` left empty take the system's; set to another
    one it is a conflict (ValueError), never silently overwritten."""
    chosen = config.scheduler.policy
    if chosen and chosen != spec.policy:
        raise ValueError(
            f"scheduler.policy={chosen!r} conflicts with system {spec.name!r} (policy "
            f"{spec.policy!r}): leave scheduler.policy unset or run a system with that policy"
        )
    mechanism = config.reuse.mechanism
    if mechanism and mechanism != spec.reuse:
        raise ValueError(
            f"reuse.mechanism={mechanism!r} conflicts with system {spec.name!r} (reuse "
            f"{spec.reuse or 'none'!r}): leave reuse.mechanism unset"
        )
    return replace(
        config,
        scheduler=replace(config.scheduler, policy=spec.policy),
        reuse=replace(config.reuse, mechanism=spec.reuse),
    )
