"""Turn bookkeeping shared by the simulator and the runtime (STYLE §1, §2).

Pure and I/O-free, between ``policy`` and the two shells: topology ids, each turn's typed
phase, the load counters and the ``ClusterView`` the policy reads, ``TurnRecord``s, and typed
past-tense events that observers subscribe to. The shells carry out commands and report
what happened; they keep no counter or view of their own.
"""

from dualpath.ledger.events import (
    Assigned,
    DecodeStepsDone,
    EventBus,
    FirstToken,
    ForwardDone,
    ForwardStarted,
    Persisted,
    ReadDone,
    Submitted,
    TransferDone,
    TurnDone,
)
from dualpath.ledger.ledger import Ledger, decode_block_tokens, prompt_block_tokens
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import NO_TIME, Phase, Turn

__all__ = [
    "NO_TIME",
    "Assigned",
    "DecodeStepsDone",
    "EventBus",
    "FirstToken",
    "ForwardDone",
    "ForwardStarted",
    "Ledger",
    "Persisted",
    "Phase",
    "ReadDone",
    "Submitted",
    "Topology",
    "TransferDone",
    "Turn",
    "TurnDone",
    "decode_block_tokens",
    "prompt_block_tokens",
]
