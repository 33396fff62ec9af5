"""The scheduler's doors, the half of ``Scheduler`` its callers use: agents and turns in (on
its thread, or from any thread through queues the loop drains), cancels, aborts and
resubmission after a failure. The components and the loop are set up by ``Scheduler``."""

from __future__ import annotations

import json
import queue
import sys
from concurrent.futures import Future
from typing import Any, TextIO

from dualpath.ledger import Ledger, Phase, Topology
from dualpath.ledger.core import Core
from dualpath.ledger.counters import RunCounters
from dualpath.metrics import TurnRecord
from dualpath.policy import ClusterView
from dualpath.policy.base import Policy
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.launcher import Launcher
from dualpath.runtime.messages import CancelMsg, WakeMsg
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.decodes import Decodes
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.intake import Intake
from dualpath.runtime.scheduler.passes import Passes
from dualpath.runtime.scheduler.recovery import resume
from dualpath.runtime.scheduler.slots import Pools, Slots
from dualpath.runtime.scheduler.stats import STATS_PUBLISH_S, SchedulerStats, snapshot
from dualpath.runtime.scheduler.streams import Streams, TokenCallback


class SchedulerApi:
    core: Core[AgentState]
    ledger: Ledger
    policy: Policy
    topo: Topology
    counters: RunCounters
    gpu: dict[int, GpuUse]
    launcher: Launcher
    intake: Intake
    passes: Passes
    decodes: Decodes
    pools: Pools
    slots: Slots
    streams: Streams
    durability: Durability
    reqs: dict[int, Req]
    rejected: list[str]
    num_cancelled: int
    stats: SchedulerStats
    _stats_every_s: float | None
    _stats_at_s: float
    _journal_file: TextIO | None
    _external: queue.SimpleQueue[tuple[Any, ...]]
    _cancels: queue.SimpleQueue[int]

    def now(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ what it reports
    @property
    def agents(self) -> dict[int, AgentState]:
        return self.core.agents.agents

    @property
    def records(self) -> list[TurnRecord]:
        return self.core.records

    @property
    def free_pages(self) -> dict[int, int]:
        """Every engine's free HBM pages, as last reported."""
        return self.pools.free_pages

    @property
    def hbm_pages(self) -> int:
        """A DE's HBM pool, pages of one Layer Block."""
        return self.pools.hbm_pages

    @property
    def read_q(self) -> list[int]:
        """Hit tokens queued or being read per node (the ledger's read_q)."""
        return list(self.ledger.read_q)

    def view(self) -> ClusterView:
        """What the engines report at a pull (the ledger's view)."""
        return self.ledger.view()

    def record_ledger(self, path: str) -> None:
        """Write every ledger input of this run to ``path``, one JSON record a line (for
        ``dualpath.ledger.replay``); call before the first turn is submitted."""
        out = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed when the run ends)
        self._journal_file = out

        def write(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")

        self.core.start_journal(write)

    def publish_stats(self, every_s: float = STATS_PUBLISH_S) -> None:
        """Publish ``stats`` (a frozen snapshot another thread may read) every ``every_s``."""
        self._stats_every_s = every_s
        self._publish()

    def _publish(self) -> None:
        p, i = self.passes, self.intake
        self._stats_at_s = now = self.now()
        self.stats = snapshot(now, self.counters, list(self.ledger.read_q), p.pe_queue,
                              self.policy.num_waiting, len(i.alloc_wait), self.num_cancelled,
                              self.gpu, self.topo)  # fmt: skip

    # ------------------------------------------------------------------ agents and turns
    def add_agent(self, agent: AgentState) -> None:
        self.core.agents.add(agent)

    def start_agent(self, agent: AgentState) -> None:
        """Submit ``agent``'s next turn now (the agent driver submits each later one)."""
        self.core.agents.next_turn(agent.agent_id, self.now())

    def _next_turn(self, agent: AgentState, arrival_s: float) -> None:
        """The agent driver's: submit ``agent``'s next turn, arrived at ``arrival_s``."""
        nxt = agent.next_turn()
        assert nxt is not None, "the agent driver submits only an unfinished agent's turn"
        self.submit_or_reject(agent.agent_id, *nxt, arrival_s=arrival_s)

    def submit_turn(
        self,
        agent_id: int,
        append: tuple[int, ...],
        output_tokens: int,
        arrival_s: float | None = None,
        sampling: SamplingParams | None = None,
    ) -> Req:
        """Build and submit the next turn of ``agent_id`` (arrived at ``arrival_s``, default
        now; ``sampling`` None: greedy); ValueError on a bad request."""
        agent = self.core.agents.get(agent_id)
        if agent is None:
            raise ValueError(f"request for agent {agent_id} is invalid: unknown agent")
        return self.intake.submit(agent, append, output_tokens, arrival_s, sampling)

    def submit_or_reject(
        self,
        agent_id: int,
        append: tuple[int, ...],
        output_tokens: int,
        arrival_s: float | None = None,
    ) -> Req | None:
        """``submit_turn``, but a bad turn (e.g. past the context limit) is rejected alone: it
        is reported in one line and ends its agent's script (later turns only grow); the run
        goes on."""
        try:
            return self.submit_turn(agent_id, append, output_tokens, arrival_s)
        except ValueError as err:
            agent = self.core.agents[agent_id]
            self.rejected.append(f"agent {agent_id} turn {agent.turn}: {err}")
            print(f"dualpath: turn rejected: {self.rejected[-1]}", file=sys.stderr)
            agent.turn = len(agent.appends)
            return None

    def submit_threadsafe(
        self,
        agent: AgentState,
        append: tuple[int, ...],
        output_tokens: int,
        on_tokens: TokenCallback | None = None,
        sampling: SamplingParams | None = None,
    ) -> Future[int]:
        """Submit a turn of ``agent`` from any thread (added if new; its context grows with
        each finished turn). The future gets the request id, or the ValueError of a bad
        request; ``on_tokens`` is called on the scheduler's thread as tokens arrive."""
        fut: Future[int] = Future()
        self._external.put((agent, append, output_tokens, on_tokens, fut, sampling))
        self.launcher.results.put(WakeMsg())  # the loop takes it now, not at its next round
        return fut

    def cancel_threadsafe(self, request_id: int) -> None:
        """Abort request ``request_id`` from any thread (its client is gone): its callback
        gets no more tokens; buffer slots and HBM are freed once no process writes them."""
        self._cancels.put(request_id)
        self.launcher.results.put(WakeMsg())

    def _drain_external(self) -> None:
        while True:
            try:
                rid = self._cancels.get_nowait()
            except queue.Empty:
                break
            self._cancel(rid)
        while True:
            try:
                item = self._external.get_nowait()
            except queue.Empty:
                return
            # a resend of a conversation whose last turn's blocks are still being written
            # waits for them (then hits them); anything else goes now
            if not self.durability.hold(self.intake.keys(item[0], item[1]), item):
                self._submit_external(item)

    def _submit_external(self, item: tuple[Any, ...]) -> None:
        agent, append, output_tokens, on_tokens, fut, sampling = item
        if agent.agent_id not in self.core.agents:
            self.core.agents.add(agent)
        try:
            req = self.submit_turn(agent.agent_id, append, output_tokens, sampling=sampling)
        except ValueError as err:
            fut.set_exception(err)
            return
        if on_tokens is not None:
            self.streams.watch(req.request_id, on_tokens)
        fut.set_result(req.request_id)

    def _on_wake(self, _: WakeMsg) -> None:  # a submission or cancel: this round takes it
        pass

    def forget(self, rid: int) -> None:
        """Drop a finished request and its agent once no message can refer to them (a
        server's long run); on the scheduler's thread only (e.g. from a submit callback)."""
        req = self.reqs.get(rid)
        if req is not None and req.phase is Phase.DONE:
            del self.reqs[rid]
            self.core.agents.forget(req.agent_id)

    # ------------------------------------------------------------------ aborts
    def _cancel(self, rid: int) -> None:
        """Abort ``rid`` now if its phase allows, else mark it (aborted when scheduled). Slots
        a process may still write (a read, a pass, a DE not yet loaded) are freed when it
        reports back; a DE drops the request on ``CancelMsg``."""
        req = self.reqs.get(rid)
        self.streams.drop(rid)
        if req is None or req.phase in (Phase.DONE, Phase.ABORTED):
            return
        self.num_cancelled += 1
        if req.phase is Phase.QUEUED:  # the policy still holds it: aborted when it assigns it
            req.cancelled = True
            return
        in_flight = req.reading or req.in_pass
        if req.phase is Phase.DECODING:
            in_flight = not req.loaded
            self.launcher.send(req.de, CancelMsg(rid))
        self._abort(req, free_now=not in_flight)
        if not in_flight:
            self.passes.kick(self.core.topology.group_of(req.pe))

    def _abort(self, req: Req, free_now: bool) -> None:
        self.ledger.abort(req, self.now())  # it leaves every counter
        self.durability.forget(req.request_id)
        self.decodes.leave(req)
        self.passes.drop(req)
        if free_now:
            self.slots.free(req)

    def _resubmit(self, req: Req) -> None:
        """Submit an aborted request again (``recovery.resume``): a streaming turn goes on
        after the tokens its client has; one they already end is finished here."""
        cb = self.streams.drop(req.request_id)
        agent = self.core.agents[req.agent_id]
        plan = resume(req, agent.context, streaming=cb is not None)
        if plan.finished:
            agent.finish_turn(req.tokens[: len(req.tokens) - len(req.resumed)], plan.resumed)
            if cb is not None:
                cb(req.request_id, plan.resumed, True)
            return
        again = self.submit_turn(req.agent_id, plan.append, plan.output_tokens,
                                 sampling=plan.sampling)  # fmt: skip
        again.resumed = plan.resumed
        again.logprobs = req.logprobs[: len(plan.resumed)]
        if cb is not None:
            self.streams.watch(again.request_id, cb)
