"""The five systems of SPEC §11 as simulator settings: which policy, layerwise or not, Oracle.

Pure mapping from a system name to a ``SystemSpec``; everything else (workload, seed, cost
model, hardware) is shared by all systems of a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dualpath.config import Config
from dualpath.config.sim import SYSTEM_NAMES

_POLICY = {
    "basic": "basic",
    "layer": "basic",
    "dpl": "dpl",
    "dualpath": "dualpath",
    "oracle": "dualpath",
}


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """``layerwise``: SPEC §8 layerwise prefill; ``oracle``: storage reads, H2D/D2H and PD
    transfers take zero time (only compute and collectives take time)."""

    name: str
    policy: str
    layerwise: bool
    oracle: bool

    def __post_init__(self) -> None:
        if self.name not in SYSTEM_NAMES:
            raise ValueError(
                f"system={self.name!r} is invalid: must be one of {', '.join(SYSTEM_NAMES)}"
            )


def system_spec(name: str) -> SystemSpec:
    """``basic`` → basic policy, no layerwise; ``layer`` → + layerwise; ``dpl`` → dpl policy;
    ``dualpath`` → dualpath policy; ``oracle`` → dualpath with free transfers."""
    key = name.strip().lower()
    if key not in _POLICY:
        raise ValueError(f"system={name!r} is invalid: must be one of {', '.join(SYSTEM_NAMES)}")
    return SystemSpec(key, _POLICY[key], layerwise=key != "basic", oracle=key == "oracle")


def config_for(config: Config, spec: SystemSpec) -> Config:
    """``config`` with the system's policy selected (nothing else changes)."""
    return replace(config, scheduler=replace(config.scheduler, policy=spec.policy))
