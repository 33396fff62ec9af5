"""Frozen configuration: hardware, model, cluster, scheduler, workload; presets; load/override/dump."""

from dualpath.config.cluster import ClusterConfig
from dualpath.config.hardware import HardwareConfig
from dualpath.config.loader import apply_overrides, dump_json, from_dict, load_toml, to_dict
from dualpath.config.model import ModelConfig
from dualpath.config.presets import (
    CLUSTER_PRESETS,
    DEFAULT_PRESET,
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    preset,
)
from dualpath.config.root import Config, config_for
from dualpath.config.scheduler import SchedulerConfig
from dualpath.config.sim import SimConfig
from dualpath.config.workload import WorkloadConfig

__all__ = [
    "CLUSTER_PRESETS",
    "DEFAULT_PRESET",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "ClusterConfig",
    "Config",
    "HardwareConfig",
    "ModelConfig",
    "SchedulerConfig",
    "SimConfig",
    "WorkloadConfig",
    "apply_overrides",
    "config_for",
    "dump_json",
    "from_dict",
    "load_toml",
    "preset",
    "to_dict",
]
