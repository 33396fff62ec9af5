"""Typed past-tense events of a run, and the bus observers subscribe to.

Turn events (``Submitted`` … ``TurnDone``, ``Aborted``) are the same in every shell; the
simulator and the runtime report a PE group's passes (``ForwardStarted``, ``ForwardDone``),
and the simulator also its other physical work (``TransferDone``, ``DecodeStepsDone``) for
traces and balance metrics. The ledger's other inputs and decisions (``ReadStarted``,
``NodeReadDone``, ``PassStarted``, ``ChunkDone``, ``Loaded``, ``FreeHbmReported``,
``GeneratedCounted``, ``Pulled``, ``Planned``) are what its journal (``ledger.journal``)
records. An observer must not change what happens: handlers run synchronously, in
subscription order, and may only record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from dualpath.ledger.turn import Turn
from dualpath.policy import Assign, ClusterView
from dualpath.policy.base import PendingPrefill
from dualpath.policy.commands import ForwardBatch


@dataclass(frozen=True, slots=True)
class Submitted:
    """A turn reached the scheduler's queue."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class Assigned:
    """The policy gave the turn its PE, DE and read side (``turn.pe`` / ``de`` / ``read_side``)
    with ``assign``; ``read``: False when its reads are skipped (the Oracle)."""

    now: float
    turn: Turn
    assign: Assign
    read: bool = True


@dataclass(frozen=True, slots=True)
class ReadStarted:
    """A storage read of ``num_bytes`` for the turn started on ``node``."""

    now: float
    turn: Turn
    node: int
    num_bytes: float


@dataclass(frozen=True, slots=True)
class NodeReadDone:
    """The turn's storage read on ``node`` finished (``ReadDone`` follows after its last)."""

    now: float
    turn: Turn
    node: int


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Every hit block of the turn is in a buffer (at once when nothing is read)."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class PassStarted:
    """A chunk of the turn's prompt went into a PE forward pass."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class ChunkDone:
    """A chunk of ``new_tokens`` of the turn's prompt came out of its pass, not its last
    (its last ends with ``FirstToken``)."""

    now: float
    turn: Turn
    new_tokens: int


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The turn's prefill is done: the PE produced token 1 (design §9's TTFT ends here)."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class Loaded:
    """The turn's DE admitted it into HBM (the runtime): its reservation ended."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class TurnDone:
    """The turn's last token is out; ``record`` is its finished ``TurnRecord``."""

    now: float
    turn: Turn
    record: Any  # dualpath.metrics.TurnRecord


@dataclass(frozen=True, slots=True)
class Aborted:
    """The turn was dropped before it finished (its client left, or an engine it depended on
    died: the runtime submits it again as a new turn). It left every counter."""

    now: float
    turn: Turn


@dataclass(frozen=True, slots=True)
class FreeHbmReported:
    """Engine ``engine`` reported ``tokens`` of KV that fit in its free HBM (the runtime)."""

    engine: int
    tokens: int


@dataclass(frozen=True, slots=True)
class GeneratedCounted:
    """A view found DE group ``members``' generated tokens moved to ``values`` (per member)."""

    members: tuple[int, ...]
    values: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Pulled:
    """A pull: the policy saw ``view`` and decided ``assigns`` (each then ``Assigned``)."""

    now: float
    view: ClusterView
    assigns: tuple[Assign, ...]


@dataclass(frozen=True, slots=True)
class Planned:
    """PE ``pe``'s next pass over its ``pending`` queue, with HBM ``budget`` (None: none) and
    ``cap_s`` (a group's balance cap, None: none), is ``batch``."""

    now: float
    pe: int
    pending: tuple[PendingPrefill, ...]
    budget: int | None
    cap_s: float | None
    batch: ForwardBatch


@dataclass(frozen=True, slots=True)
class Persisted:
    """``num_bytes`` of a node's KV blocks (``turn``'s, where the shell knows it) were
    handed to storage."""

    now: float
    node: int
    num_bytes: float
    turn: Turn | None = None


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A flow of ``kind`` over ``path`` (resource ids) moved ``size_bytes`` in
    ``[start_s, now]``."""

    now: float
    kind: str
    path: tuple[int, ...]
    size_bytes: float
    start_s: float


@dataclass(frozen=True, slots=True)
class ForwardStarted:
    """A PE group started a forward pass: ``batches`` = ``(pe, ((cached, new), ...))`` per PE
    with work, in PE order; ``members`` = every PE of the group."""

    now: float
    members: tuple[int, ...]
    batches: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


@dataclass(frozen=True, slots=True)
class ForwardDone:
    """The pass that ``ForwardStarted`` at ``start_s`` ended."""

    now: float
    members: tuple[int, ...]
    batches: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    start_s: float


@dataclass(frozen=True, slots=True)
class DecodeStepsDone:
    """A DE group ran ``steps`` lockstep decode steps in ``[start_s, now]`` with ``batch[i]``
    requests resident on ``members[i]``."""

    now: float
    members: tuple[int, ...]
    batch: tuple[int, ...]
    steps: int
    start_s: float


E = TypeVar("E")


class EventBus:
    """``subscribe(kind, handler)``; a shell calls ``wants(kind)`` before building an event it
    would only emit for observers (so a run without observers pays nothing), then ``emit``."""

    __slots__ = ("_handlers",)

    def __init__(self) -> None:
        self._handlers: dict[type, list[Callable[[Any], None]]] = {}

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._handlers.setdefault(kind, []).append(handler)

    def wants(self, kind: type) -> bool:
        return kind in self._handlers

    def emit(self, event: object) -> None:
        for handler in self._handlers.get(type(event), ()):
            handler(event)

    def kinds(self) -> Sequence[type]:
        """Event kinds with at least one subscriber, in first-subscription order."""
        return tuple(self._handlers)
