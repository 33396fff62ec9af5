"""The one door from a shell to the shared core: a shell submits turns, pulls the policy's
assignments, plans a PE group's pass and reports each completion of a turn's lifecycle
(``lifecycle``) here, and nowhere else in the ledger or the policy.

Behind the door: the policy, the ``Ledger`` (design §13.4's counters, the view, each turn's
state, its record), the event bus, the run's counters (KV bytes per load path, passes:
``RunCounters``), the turn table and the agent driver that submits each agent's next turn.
Both shells build one ``Core``; neither keeps a counter, a view or a turn state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from dualpath.ledger.agents import A, AgentDriver
from dualpath.ledger.counters import RUNTIME_PATHS, RunCounters
from dualpath.ledger.events import EventBus, TurnDone
from dualpath.ledger.journal import JournalSink
from dualpath.ledger.ledger import Ledger
from dualpath.ledger.lifecycle import Phase
from dualpath.ledger.residency import Residency
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import Turn
from dualpath.metrics import TurnRecord
from dualpath.policy import ClusterView
from dualpath.policy.base import PendingPrefill, Policy
from dualpath.policy.commands import ForwardBatch
from dualpath.types import EngineKind, KVPath

T = TypeVar("T", bound=Turn)
# a storage read to start: (node, hit tokens)
Read = tuple[int, int]


class Core(Generic[A, T]):
    """``submit_next(agent, arrival_s)``: the shell builds and submits ``agent``'s next turn
    when the driver says so (``agents.next_turn``). ``turns``: every turn submitted and not
    yet dropped by the shell (``forget``), by request id. ``records`` holds every finished
    turn's record, in finishing order. ``paths``: the load paths the shell tells apart (the
    runtime's, or ``counters.SIM_PATHS``), counted in ``counters.bytes_by_path``.

    The completions a shell reports, in lifecycle order (each the ledger's, which moves the
    turn and refuses one out of order): ``read_started``, ``read_done``, ``pass_started``,
    ``chunk_done``, ``first_token``, ``loaded``, ``finish``, ``abort``; and the engines'
    ``report_free_hbm``."""

    def __init__(
        self,
        topology: Topology,
        policy: Policy,
        hbm_capacity_tokens: int,
        block_tokens: int,
        submit_next: Callable[[A, float], object],
        events: EventBus | None = None,
        paths: Sequence[KVPath] = RUNTIME_PATHS,
        residency: Residency | None = None,
    ) -> None:
        self.topology = topology
        self._policy = policy
        # what happened, for observers (records, traces, metrics)
        self.events = events if events is not None else EventBus()
        self._ledger = ledger = Ledger(topology, hbm_capacity_tokens, block_tokens, self.events)
        self.counters = RunCounters.over(paths)
        self.agents: AgentDriver[A] = AgentDriver(submit_next)
        self.turns: dict[int, T] = {}
        self.records: list[TurnRecord] = []
        self.events.subscribe(TurnDone, lambda ev: self.records.append(ev.record))
        self.generated: dict[int, int] = {}  # per DE, with ``count_generated``
        # the completions, straight to the ledger (bound once: the simulator calls them often)
        self.read_started = ledger.read_started
        self.read_done = ledger.read_done
        self.pass_started = ledger.pass_started
        self.chunk_done = ledger.chunk_done
        self.first_token = ledger.first_token
        self.loaded = ledger.loaded
        self.finish = ledger.finish
        self.abort = ledger.abort
        self.report_free_hbm = ledger.report_free_hbm
        self.pin = ledger.pin
        self.track_decode = ledger.track_decode
        self.view: Callable[[], ClusterView] = ledger.view
        # the reuse designs: what the engines hold beyond storage, read by the policy's rule
        self.residency = residency
        if residency is not None:
            reuse = getattr(policy, "reuse", None)
            if reuse is None:
                raise ValueError(f"policy {policy.name!r} has no reuse rule to read a residency")
            reuse.residency = residency
            self._held: Residency = residency
            self.first_token = self._first_token
            self.finish = self._finish

    # ------------------------------------------------------------------ the policy's side
    def submit(self, turn: T, now: float) -> None:
        """``turn`` arrived: the policy queues it (QUEUED)."""
        self.turns[turn.request_id] = turn
        self._policy.submit(self._ledger.submit(turn, now), now)

    @property
    def waiting(self) -> int:
        """Turns the policy holds (submitted, not yet assigned)."""
        return self._policy.num_waiting

    def pull(self, now: float, read: bool = True) -> list[tuple[T, list[Read]]]:
        """A pull (design §7.1): each turn the policy assigned (SCHEDULED, or READY when it has
        nothing to read), in decision order, with the storage reads the shell is to start
        (``read=False``, the Oracle: none). A turn cancelled while queued is aborted here,
        dropped from ``turns`` (it holds nothing; no process reports on it) and not returned."""
        if not self._policy.num_waiting:
            return []
        ledger, turns = self._ledger, self.turns
        out = []
        residency = self.residency
        if residency is not None:
            residency.expire(now)
        for a in ledger.pull(self._policy, now):
            turn = turns[a.request_id]
            reads = ledger.assign(turn, a, now, read)
            if residency is not None:
                residency.assigned(turn, ledger.reserved[turn.de], now, a.recompute_tokens)
            if turn.cancelled:
                ledger.abort(turn, now)
                del turns[a.request_id]
                continue
            out.append((turn, reads))
        return out

    def _first_token(self, turn: Turn, now: float) -> None:
        self._ledger.first_token(turn, now)
        self._held.prefill_done(turn, now)

    def _finish(self, turn: Turn, now: float) -> TurnRecord:
        record = self._ledger.finish(turn, now)
        self._held.finished(turn, self._ledger.reserved[turn.de], now)
        return record

    def plan_group(
        self, queues: Mapping[int, tuple[Sequence[PendingPrefill], int | None]], now: float
    ) -> list[tuple[int, ForwardBatch]]:
        """An EP group's next pass: PE → its queue and HBM budget in, PE → its batch out
        (``Ledger.plan_group``)."""
        return self._ledger.plan_group(self._policy, queues, now)

    def cancel(self, turn: T, now: float) -> bool:
        """``turn``'s client is gone. A queued turn is marked and aborted when the policy
        assigns it (False: nothing to do now); a turn done or aborted stays so (False);
        otherwise True: the shell frees what the turn holds and calls ``abort``."""
        if turn.phase.over:
            return False
        if turn.phase is Phase.QUEUED:
            turn.cancelled = True
            return False
        return True

    def forget(self, request_id: int) -> T | None:
        """Drop a turn that is over from the table (a long run's memory)."""
        turn = self.turns.get(request_id)
        if turn is not None and turn.phase.over:
            del self.turns[request_id]
            return turn
        return None

    # ------------------------------------------------------------------ what it reports
    @property
    def read_q(self) -> list[int]:
        """Hit tokens queued or being read, per node."""
        return list(self._ledger.read_q)

    @property
    def bytes_read(self) -> float:
        """Bytes of the storage reads started so far, all nodes."""
        return sum(self._ledger.bytes_read)

    @property
    def policy(self) -> Policy:
        """The policy, for inspection (tests, its decision trace): a shell's decisions go
        through ``pull`` and ``plan_group`` (``tests/test_layers.py`` checks the shells)."""
        return self._policy

    @property
    def ledger(self) -> Ledger:
        """The ledger, for inspection (tests, journals): a shell reports through the door's
        completions (``tests/test_layers.py`` checks the shells)."""
        return self._ledger

    def count_generated(self) -> None:
        """The DEs' generated tokens are counted here, as the shell reports each
        (``generated``), and read by the ledger at each pull (design §13.4's tok_e)."""
        topo = self.topology
        self.generated = dict.fromkeys(topo.de_ids, 0)
        for _, members in topo.groups(EngineKind.DE):
            self._ledger.track_decode(members, self._generated_fn(members))

    def _generated_fn(self, members: tuple[int, ...]) -> Callable[[], Sequence[int]]:
        generated = self.generated
        return lambda: [generated[e] for e in members]

    def generated_tokens(self, de: int, num_tokens: int) -> None:
        """DE ``de`` generated ``num_tokens`` more for its admitted turns (negative: a turn
        left it, taking its tokens along)."""
        self.generated[de] += num_tokens

    def start_journal(self, sink: JournalSink) -> None:
        """Write every ledger input from now on to ``sink`` (``Ledger.start_journal``)."""
        self._ledger.start_journal(sink)
