"""The five systems of design §11, one table: which policy, layerwise prefill or not, Oracle.

Both shells, the config checks and the policy registry read this table (``config.config_for``
applies a system to a ``Config``); a system name means
the same thing everywhere. Everything else (workload, seed, cost model, hardware) is shared
by all systems of a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """``policy``: the policy's name (``dualpath.policy.registry``); ``layerwise``: design §8
    layerwise prefill; ``oracle``: storage reads, H2D/D2H and PD transfers take zero time
    (only compute and collectives take time)."""

    name: str
    policy: str
    layerwise: bool
    oracle: bool


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("basic", "basic", layerwise=False, oracle=False),
        SystemSpec("layer", "layer", layerwise=True, oracle=False),
        SystemSpec("dpl", "dpl", layerwise=True, oracle=False),
        SystemSpec("dualpath", "dualpath", layerwise=True, oracle=False),
        SystemSpec("oracle", "dualpath", layerwise=True, oracle=True),
    )
}
SYSTEM_NAMES = tuple(SYSTEMS)
# every policy is also the system of its own name (that system is the policy, nothing more)
POLICY_NAMES = tuple(dict.fromkeys(s.policy for s in SYSTEMS.values()))


def system_spec(name: str) -> SystemSpec:
    """The system called ``name`` (case and surrounding blanks ignored)."""
    key = str(name).strip().lower()
    if key not in SYSTEMS:
        raise ValueError(f"system={name!r} is invalid: must be one of {', '.join(SYSTEM_NAMES)}")
    return SYSTEMS[key]
