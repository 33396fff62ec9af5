"""A turn's lifecycle: its states and the only transitions between them, one table for every
shell.

A shell carries out the actions (start a read, run a pass, start a decode, write blocks) and
reports each completion to the core (``ledger.Core``); the ledger moves the turn with
``advance``, which refuses a transition the table does not have (a shell reporting out of
order is a bug, named in one line). The states are what a shell asks of a turn ("is its read
out?", "is it in a pass?"); they replace per-shell flags.

    QUEUED ──assign──▶ SCHEDULED ──read_started──▶ READING ──read_done──▶ READY
                           └──────────(nothing to read)──────────────────────┘
    READY ──pass_started──▶ IN_PASS ──chunk_done──▶ READY          (a chunked prompt)
                            IN_PASS ──first_token──▶ DECODING ──finish──▶ DONE
    SCHEDULED, READING, READY, IN_PASS, DECODING ──abort──▶ ABORTED

A QUEUED turn is the policy's and holds nothing: one cancelled there is marked
(``Turn.cancelled``) and aborted by the core when the policy assigns it. An ABORTED turn that
a shell resumes (the runtime, after an engine died) is submitted again as a new turn.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol


class Phase(Enum):
    QUEUED = "queued"  # submitted; the policy holds it
    SCHEDULED = "scheduled"  # PE, DE and read side chosen; its reads not started yet
    READING = "reading"  # hit KV on its way from storage to a buffer
    READY = "ready"  # its KV so far (hits, earlier chunks) in a buffer: in its PE's queue
    IN_PASS = "in_pass"  # a chunk of its prompt in a PE forward pass
    DECODING = "decoding"  # token 1 out; on its DE (``Turn.loaded`` once the DE admitted it)
    DONE = "done"
    ABORTED = "aborted"

    @property
    def over(self) -> bool:
        """DONE or ABORTED: nothing more happens to the turn."""
        return self is Phase.DONE or self is Phase.ABORTED

    @property
    def on_pe(self) -> bool:
        """The turn still needs its PE (its prefill is not done)."""
        return self in _ON_PE


_ON_PE = frozenset((Phase.SCHEDULED, Phase.READING, Phase.READY, Phase.IN_PASS))

# state → the states it may move to
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset((Phase.SCHEDULED,)),
    Phase.SCHEDULED: frozenset((Phase.READING, Phase.READY, Phase.ABORTED)),
    Phase.READING: frozenset((Phase.READY, Phase.ABORTED)),
    Phase.READY: frozenset((Phase.IN_PASS, Phase.ABORTED)),
    Phase.IN_PASS: frozenset((Phase.READY, Phase.DECODING, Phase.ABORTED)),
    Phase.DECODING: frozenset((Phase.DONE, Phase.ABORTED)),
    Phase.DONE: frozenset(),
    Phase.ABORTED: frozenset(),
}


class Staged(Protocol):
    """What ``advance`` moves: a turn (``ledger.Turn``)."""

    request_id: int
    phase: Phase


class LifecycleError(ValueError):
    """A report that the turn's state does not allow (a shell's bug)."""


def advance(turn: Staged, to: Phase, report: str) -> None:
    """Move ``turn`` to ``to`` on ``report`` (the ledger method's name), or raise."""
    if to not in TRANSITIONS[turn.phase]:
        raise LifecycleError(
            f"request {turn.request_id}: {report} while {turn.phase.value} "
            f"(a turn {turn.phase.value} can only become "
            f"{', '.join(p.value for p in TRANSITIONS[turn.phase]) or 'nothing'})"
        )
    turn.phase = to
