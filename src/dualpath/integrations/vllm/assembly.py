"""The DualPath router, assembled in one place for both ways it runs: over the deployment
``serve --engine vllm`` launches (``launch.py``) and over instances already running
(``dualpath router``). What a system or config the vLLM shell cannot carry out is refused
in one line, before anything starts."""

from __future__ import annotations

from dualpath.config import Config, config_for
from dualpath.config.systems import shell_system
from dualpath.integrations.vllm.flow import TurnFlow
from dualpath.integrations.vllm.router import Router, RouterOptions
from dualpath.integrations.vllm.setup import READ_SIDES, READ_SIDES_ALLOWED, Deployment
from dualpath.policy import PolicyCore, make_policy
from dualpath.types import ReadSide


def router_policy(config: Config, system: str) -> PolicyCore:
    """The policy core of ``system`` for the vLLM shell; ValueError (one line) for a system
    or setting it cannot carry out."""
    if config.scheduler.split_reads:
        raise ValueError(
            "scheduler.split_reads=true is not supported by the vLLM shell (each request "
            "reads its hit KV through one node): set it to false"
        )
    return make_policy(config_for(config, shell_system(system, "the vLLM shell")))


def build_router(
    deployment: Deployment,
    policy: PolicyCore,
    kv_root: str,
    read_side: str = "policy",
    options: RouterOptions | None = None,
) -> tuple[TurnFlow, Router]:
    """The turn flow over ``deployment`` and the router in front of it; ``read_side``:
    ``policy`` (the policy picks each request's side), or a side every read is forced to.
    The caller closes the flow."""
    if read_side not in READ_SIDES:
        raise ValueError(f"read_side={read_side!r} is invalid: {READ_SIDES_ALLOWED}")
    force = None if read_side == "policy" else ReadSide(read_side)
    flow = TurnFlow(deployment, policy, kv_root, force_side=force)
    return flow, Router(flow, options or RouterOptions())
