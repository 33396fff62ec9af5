"""The one door from a shell to the shared core: the policy, the ``Ledger`` (SPEC §13.4's
counters, the view, turn phases and records), the event bus, the run's counters (KV bytes
per load path, passes: ``RunCounters``), and the agent driver that submits each agent's
next turn. Both shells build one ``Core`` and report through it; neither keeps a counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic

from dualpath.ledger.agents import A, AgentDriver
from dualpath.ledger.counters import RUNTIME_PATHS, RunCounters
from dualpath.ledger.events import EventBus, TurnDone
from dualpath.ledger.journal import JournalSink
from dualpath.ledger.ledger import Ledger
from dualpath.ledger.topology import Topology
from dualpath.metrics import TurnRecord
from dualpath.policy.base import Policy
from dualpath.types import EngineKind, KVPath


class Core(Generic[A]):
    """``submit(agent, arrival_s)``: the shell builds and submits ``agent``'s next turn when
    the driver says so (``agents.next_turn``). ``records`` holds every finished turn's
    record, in finishing order. ``paths``: the load paths the shell tells apart (the
    runtime's, or ``counters.SIM_PATHS``), counted in ``counters.bytes_by_path``."""

    def __init__(
        self,
        topology: Topology,
        policy: Policy,
        hbm_capacity_tokens: int,
        block_tokens: int,
        submit: Callable[[A, float], object],
        events: EventBus | None = None,
        paths: Sequence[KVPath] = RUNTIME_PATHS,
    ) -> None:
        self.topology = topology
        self.policy = policy
        # what happened, for observers (records, traces, metrics)
        self.events = events if events is not None else EventBus()
        self.ledger = Ledger(topology, hbm_capacity_tokens, block_tokens, self.events)
        self.counters = RunCounters.over(paths)
        self.agents: AgentDriver[A] = AgentDriver(submit)
        self.records: list[TurnRecord] = []
        self.events.subscribe(TurnDone, lambda ev: self.records.append(ev.record))
        self.generated: dict[int, int] = {}  # per DE, with ``count_generated``

    def count_generated(self) -> None:
        """The DEs' generated tokens are counted here, as the shell reports each
        (``generated``), and read by the ledger at each pull (SPEC §13.4's tok_e)."""
        topo = self.topology
        self.generated = dict.fromkeys(topo.de_ids, 0)
        for _, members in topo.groups(EngineKind.DE):
            self.ledger.track_decode(members, self._generated_fn(members))

    def _generated_fn(self, members: tuple[int, ...]) -> Callable[[], Sequence[int]]:
        generated = self.generated
        return lambda: [generated[e] for e in members]

    def generated_tokens(self, de: int, num_tokens: int) -> None:
        """DE ``de`` generated ``num_tokens`` more for its admitted turns (negative: a turn
        left it, taking its tokens along)."""
        self.generated[de] += num_tokens

    def start_journal(self, sink: JournalSink) -> None:
        """Write every ledger input from now on to ``sink`` (``Ledger.start_journal``)."""
        self.ledger.start_journal(sink)
