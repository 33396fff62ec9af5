"""Turn bookkeeping shared by every shell: the simulator, the runtime, DualPath inside vLLM.

Pure and I/O-free, between ``policy`` and the shells: topology ids; each turn's lifecycle
(``lifecycle``: its states and the only transitions between them); the load counters and the
``ClusterView`` the policy reads; ``TurnRecord``s; typed past-tense events that observers
subscribe to; a journal of the ledger's inputs (a subscriber to those events) and a replay
that checks a fresh ledger and policy decide the same; and the ``Core``, the one door a shell
calls (submit, pull, plan, each completion). The shells carry out the actions and report
what happened; they keep no counter, view or turn state of their own.
"""

from dualpath.ledger.agents import AgentDriver
from dualpath.ledger.core import Core
from dualpath.ledger.counters import RunCounters
from dualpath.ledger.events import (
    Aborted,
    Assigned,
    ChunkDone,
    DecodeStepsDone,
    EventBus,
    FirstToken,
    ForwardDone,
    ForwardStarted,
    FreeHbmReported,
    GeneratedCounted,
    Loaded,
    NodeReadDone,
    PassStarted,
    Persisted,
    Planned,
    Pulled,
    ReadDone,
    ReadStarted,
    Submitted,
    TransferDone,
    TurnDone,
)
from dualpath.ledger.journal import Journal, JournalSink, encode_view
from dualpath.ledger.ledger import Ledger, decode_block_tokens, prompt_block_tokens
from dualpath.ledger.lifecycle import TRANSITIONS, LifecycleError, Phase
from dualpath.ledger.replay import ReplayMismatch, ReplayStats, replay
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import NO_TIME, Turn

__all__ = [
    "NO_TIME",
    "TRANSITIONS",
    "Aborted",
    "AgentDriver",
    "Assigned",
    "ChunkDone",
    "Core",
    "DecodeStepsDone",
    "EventBus",
    "FirstToken",
    "ForwardDone",
    "ForwardStarted",
    "FreeHbmReported",
    "GeneratedCounted",
    "Journal",
    "JournalSink",
    "Ledger",
    "LifecycleError",
    "Loaded",
    "NodeReadDone",
    "PassStarted",
    "Persisted",
    "Phase",
    "Planned",
    "Pulled",
    "ReadDone",
    "ReadStarted",
    "ReplayMismatch",
    "ReplayStats",
    "RunCounters",
    "Submitted",
    "Topology",
    "TransferDone",
    "Turn",
    "TurnDone",
    "decode_block_tokens",
    "encode_view",
    "prompt_block_tokens",
    "replay",
]
