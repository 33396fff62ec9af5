"""The DualPath policy core (design §7): deterministic, no I/O, no clock (`now` is an argument).

Shared by the simulator and the runtime; decisions come back as frozen command objects.
"""

from dualpath.policy.base import PendingPrefill, Policy
from dualpath.policy.commands import Assign, Chunk, ForwardBatch
from dualpath.policy.core import PolicyCore
from dualpath.policy.intra import GroupForwardPlan, pack_forward
from dualpath.policy.params import PolicyParams, params_from_config
from dualpath.policy.registry import POLICY_NAMES, build_policy, make_policy
from dualpath.policy.side import ReadPlan, split_hit
from dualpath.policy.trace import explain, read_jsonl, to_jsonl, write_jsonl
from dualpath.policy.view import ClusterView, EngineState, NodeState, RequestInfo

__all__ = [
    "POLICY_NAMES",
    "Assign",
    "Chunk",
    "ClusterView",
    "EngineState",
    "ForwardBatch",
    "GroupForwardPlan",
    "NodeState",
    "PendingPrefill",
    "Policy",
    "PolicyCore",
    "PolicyParams",
    "ReadPlan",
    "RequestInfo",
    "build_policy",
    "explain",
    "make_policy",
    "pack_forward",
    "params_from_config",
    "read_jsonl",
    "split_hit",
    "to_jsonl",
    "write_jsonl",
]
