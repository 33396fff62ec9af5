"""Frozen configuration: hardware, model, cluster, scheduler, workload; presets; load/override/dump."""

from collections.abc import Iterable

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


def _from_preset(cls: type[Config], name: str, overrides: Iterable[str] = ()) -> Config:
    """The cluster preset ``name`` (``dualpath presets`` lists them) with ``--set``-style
    ``section.key=value`` overrides applied in order; ValueError naming any mistake."""
    return apply_overrides(preset(name), overrides)


def _with_overrides(self: Config, *overrides: str) -> Config:
    """This config with ``section.key=value`` overrides applied in order."""
    return apply_overrides(self, overrides)


# The public constructors of the Python API (docs/api.md). They need the presets and the
# loader, which import Config: bound here, where all three are loaded, so that root.py
# imports neither (no import circle; root.py declares them for the type checker).
Config.from_preset = classmethod(_from_preset)  # type: ignore[assignment,method-assign]
Config.with_overrides = _with_overrides  # type: ignore[method-assign]

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
