"""The systems, one table: which policy, layerwise prefill or not, Oracle, and which reuse
mechanism. The paper's five (design §11), then the designs the field ships instead of
DualPath and dualpath-resident (docs/peers.md).

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
    (only compute and collectives take time); ``reuse``: the mechanism that finds hits
    without storage (``config.reuse.MECHANISMS``, "" for none); ``persist``: the turns' new
    blocks are written to storage (not by a system that has no storage tier)."""

    name: str
    policy: str
    layerwise: bool
    oracle: bool
    reuse: str = ""
    persist: bool = True


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec("basic", "basic", layerwise=False, oracle=False),
        SystemSpec("layer", "layer", layerwise=True, oracle=False),
        SystemSpec("dpl", "dpl", layerwise=True, oracle=False),
        SystemSpec("dualpath", "dualpath", layerwise=True, oracle=False),
        SystemSpec("oracle", "dualpath", layerwise=True, oracle=True),
        # the field's designs (docs/peers.md): engines that prefill whole passes, placed by
        # Basic's rule where no engine holds the request's KV, and their reuse added
        SystemSpec("recompute", "basic", False, False, reuse="recompute", persist=False),
        SystemSpec("d2p", "basic", False, False, reuse="d2p"),
        # d2p whose held blocks yield to new turns (evictable): a what-if beyond vLLM's
        SystemSpec("d2p-evictable", "basic", False, False, reuse="d2p-evictable"),
        SystemSpec("both-read", "basic", False, False, reuse="both-read"),
        SystemSpec("dram-tier", "basic", False, False, reuse="dram-tier"),
        SystemSpec("dualpath-resident", "dualpath", True, False, reuse="resident"),
    )
}
SYSTEM_NAMES = tuple(SYSTEMS)
# every policy is also the system of its own name (that system is the policy, nothing more)
POLICY_NAMES = tuple(dict.fromkeys(s.policy for s in SYSTEMS.values()))
# the systems every shell runs (the paper's five; the reuse designs: ``shell_system``)
SHELL_SYSTEM_NAMES = tuple(n for n, s in SYSTEMS.items() if not s.reuse)


def system_spec(name: str) -> SystemSpec:
    """The system called ``name`` (case and surrounding blanks ignored)."""
    key = str(name).strip().lower()
    if key not in SYSTEMS:
        raise ValueError(f"system={name!r} is invalid: must be one of {', '.join(SYSTEM_NAMES)}")
    return SYSTEMS[key]


def shell_system(name: str, shell: str, reuses: tuple[str, ...] = ()) -> SystemSpec:
    """``system_spec(name)`` for a shell that runs the paper's five systems and the reuse
    mechanisms ``reuses``: another reuse design is refused in one line."""
    spec = system_spec(name)
    if spec.reuse and spec.reuse not in reuses:
        runs = [*SHELL_SYSTEM_NAMES, *(n for n, s in SYSTEMS.items() if s.reuse in reuses)]
        raise ValueError(
            f"system={name!r} runs only in the simulator so far (docs/peers.md): {shell} runs "
            + ", ".join(runs)
        )
    return spec
