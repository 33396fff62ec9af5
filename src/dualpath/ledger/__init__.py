"""Turn bookkeeping shared by the simulator and the runtime (STYLE §1, §2).

Pure and I/O-free, between ``policy`` and the two shells: topology ids, each turn's typed
phase, the load counters and the ``ClusterView`` the policy reads, ``TurnRecord``s, and typed
past-tense events that observers subscribe to; a journal of its inputs (a subscriber to those
events) and a replay that checks a fresh ledger and policy decide the same; the ``Core`` that a shell reports through
(policy, ledger, event bus, the run's counters, the agent driver). The shells carry out
commands and report what happened; they keep no counter or view of their own.
"""

from dualpath.ledger.agents import AgentDriver
from dualpath.ledger.core import Core
from dualpath.ledger.counters import RunCounters
from dualpath.ledger.events import (
    Aborted,
    Assigned,
    DecodeStepsDone,
    EventBus,
    FirstToken,
    ForwardDone,
    ForwardStarted,
    FreeHbmReported,
    GeneratedCounted,
    Loaded,
    NodeReadDone,
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
from dualpath.ledger.replay import ReplayMismatch, ReplayStats, replay
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import NO_TIME, Phase, Turn

__all__ = [
    "NO_TIME",
    "Aborted",
    "AgentDriver",
    "Assigned",
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
    "Loaded",
    "NodeReadDone",
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
