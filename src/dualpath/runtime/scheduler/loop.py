"""The scheduler: a loop over components that own their state; ``handlers.py`` wires them.

One round is: take what other threads queued (``Inbox``) → recover dead processes → a pull
(the policy's assignments, through the ``Core``) → buffer slots and reads → wait for a
message; each message type has one handler (``handlers.HANDLERS``). The components — ``Intake``
(turns in, the slot queue, reads), ``Passes`` (PE queues, group passes), ``Decodes`` (a turn
on its DE), ``Durability`` (acks, resends held for blocks in flight), ``Recovery`` (dead
processes), ``Streams`` (token callbacks), ``Inbox`` (other threads' submissions) — never call
each other (``tests/runtime/test_scheduler_parts.py``): a handler hands one's result to the
next. They share the ``Core`` (the one door to the ledger and the policy: every
counter, the view, each turn's lifecycle state), the buffer ``Slots`` and the HBM ``Pools``.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TextIO

from dualpath.ledger import Phase
from dualpath.ledger.core import Core
from dualpath.metrics import TurnRecord
from dualpath.policy.base import Policy
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.launcher import Launcher, RuntimeFailure
from dualpath.runtime.messages import WakeMsg
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.result import RunResult
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.decodes import Decodes
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.handlers import HANDLERS, Handlers, Parts
from dualpath.runtime.scheduler.holds import Holds, d2p_residency, recompute_beyond
from dualpath.runtime.scheduler.inbox import Inbox, Submission
from dualpath.runtime.scheduler.intake import Intake
from dualpath.runtime.scheduler.passes import Passes, kv_budget_tokens
from dualpath.runtime.scheduler.recovery import Recovery
from dualpath.runtime.scheduler.slots import Pools, Slots
from dualpath.runtime.scheduler.stats import STATS_PUBLISH_S, Publisher, SchedulerStats, snapshot
from dualpath.runtime.scheduler.streams import Streams, TokenCallback
from dualpath.runtime.scheduler.writes import Writes

IDLE_WAIT_S = 0.005


class Scheduler:
    def __init__(self, launcher: Launcher, env: ProcEnv, policy: Policy) -> None:
        self.launcher, self.env = launcher, env
        self.topo = topo = env.topology
        block = env.block_tokens
        layerwise = bool(getattr(policy, "layerwise", True))
        num_layers = env.config.model.num_layers
        # every engine's HBM pool: pages of one Layer Block; engines report their free pages
        pages = env.options.hbm_pages(num_layers, block)  # a DE's
        pe_pages = env.options.hbm_pages(num_layers, block, pe=True)
        # d2p (docs/peers.md): decode-side holds, bookkept by the ledger, carried out here
        self.holds: Holds | None = None
        residency = None
        if env.options.spec.reuse == "d2p":
            self.holds = Holds(launcher, topo, block)
            ttl = env.config.reuse.d2p_ttl_s
            residency = d2p_residency(topo, block, pages // num_layers * block, ttl)
            residency.set_released(self.holds.released)
        self.core: Core[AgentState, Req] = Core(
            topo,
            policy,
            pages // num_layers * block,
            block,
            self._next_turn,
            residency=residency,
        )
        self.core.count_generated()
        self.events, self.counters = self.core.events, self.core.counters
        self.pools = Pools(self.core.report_free_hbm, topo, pages, pe_pages, num_layers, block)
        self.slots = Slots(launcher, topo, block)
        self.intake = Intake(
            launcher.send_storage, env, self.core, self.slots, self.counters, pages, self.now
        )
        self.reqs: dict[int, Req] = self.core.turns
        self.passes = Passes(
            topo,
            self.core,
            launcher,
            self.slots,
            self.reqs,
            self.counters,
            self.events,
            lambda p: kv_budget_tokens(p, pe_pages, num_layers, block, layerwise),
            layerwise,
            env.options.batching,
            self.now,
        )
        full = env.layout.full_block_bytes
        self.decodes = Decodes(self.core, topo, self.slots, launcher, self.reqs, block, full)
        self.decodes.hold = self.holds is not None and env.config.reuse.d2p_ttl_s > 0
        self.durability = Durability()
        self.writes = Writes()
        self.recovery = Recovery()
        # called on this thread with why the runtime is not ready ("" : ready again) each time
        # that changes: a process is being restarted, or every restarted one acked
        self.on_health: Callable[[str], None] | None = None
        self.streams = Streams()
        self.inbox = Inbox(lambda: launcher.results.put(WakeMsg()))
        self.publisher = Publisher()
        self.gpu: dict[int, GpuUse] = {}  # per engine, emulated GPU time only
        self.rejected: list[str] = []  # turns rejected alone (one line each)
        self._journal_file: TextIO | None = None  # record_ledger's output
        parts = Parts(
            launcher=launcher,
            env=env,
            topo=topo,
            core=self.core,
            counters=self.counters,
            reqs=self.reqs,
            pools=self.pools,
            slots=self.slots,
            intake=self.intake,
            passes=self.passes,
            decodes=self.decodes,
            durability=self.durability,
            writes=self.writes,
            recovery=self.recovery,
            streams=self.streams,
            holds=self.holds,
            gpu=self.gpu,
            tiering=env.options.spec.reuse == "dram-tier",
            now=self.now,
        )
        self.handlers = Handlers(parts, self._submit, self._health, self._drain)

    @staticmethod
    def handled_messages() -> tuple[type, ...]:
        """The message types the run loop handles (one handler each: ``handlers.py``)."""
        return tuple(HANDLERS)

    def now(self) -> float:
        return self.env.clock.now()

    # ------------------------------------------------------------------ what it reports
    @property
    def agents(self) -> dict[int, AgentState]:
        return self.core.agents.agents

    @property
    def records(self) -> list[TurnRecord]:
        return self.core.records

    @property
    def stats(self) -> SchedulerStats:
        """The last published snapshot (``publish_stats``); any thread may read it."""
        return self.publisher.stats

    @property
    def free_pages(self) -> dict[int, int]:
        """Every engine's free HBM pages, as last reported."""
        return self.pools.free_pages

    @property
    def hbm_pages(self) -> int:
        """A DE's HBM pool, pages of one Layer Block."""
        return self.pools.hbm_pages

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
        self.publisher.start(every_s)
        self._publish()

    def _publish(self) -> None:
        now = self.now()
        self.publisher.publish(
            snapshot(
                now,
                self.counters,
                self.core.read_q,
                self.passes.pe_queue,
                self.core.waiting,
                len(self.intake.alloc_wait),
                self.handlers.num_cancelled,
                self.gpu,
                self.topo,
            )
        )

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
        self.inbox.submit(Submission(agent, append, output_tokens, on_tokens, fut, sampling))
        return fut

    def cancel_threadsafe(self, request_id: int) -> None:
        """Abort request ``request_id`` from any thread (its client is gone): its callback
        gets no more tokens; buffer slots and HBM are freed once no process writes them."""
        self.inbox.cancel(request_id)

    def forget(self, rid: int) -> None:
        """Drop a finished request and its agent once no message can refer to them (a
        server's long run); on the scheduler's thread only (e.g. from a submit callback)."""
        req = self.reqs.get(rid)
        if req is not None and req.phase is Phase.DONE:
            self.core.forget(rid)
            self.core.agents.forget(req.agent_id)

    def _take_inbox(self) -> None:
        for rid in self.inbox.cancels():
            self.handlers.cancel(rid)
        for item in self.inbox.submissions():
            # a resend of a conversation whose last turn's blocks are still being written
            # waits for them (then hits them); anything else goes now
            if not self.durability.hold(self.intake.keys(item.agent, item.append), item):
                self._submit(item)

    def _submit(self, item: Submission) -> None:
        if item.agent.agent_id not in self.core.agents:
            self.core.agents.add(item.agent)
        try:
            req = self.submit_turn(
                item.agent.agent_id, item.append, item.output_tokens, sampling=item.sampling
            )
        except ValueError as err:
            item.future.set_exception(err)
            return
        if item.on_tokens is not None:
            self.streams.watch(req.request_id, item.on_tokens)
        item.future.set_result(req.request_id)

    # ------------------------------------------------------------------ one round
    def admit(self) -> None:
        """A pull: the policy's assignments wait for their buffer slots."""
        self.intake.admit()

    def try_alloc(self) -> None:
        """Give waiting turns their slots, FIFO, and start their reads; turns with nothing to
        read join their PE's queue, each group's next pass planned after the whole round."""
        self.passes.begin_round()
        try:
            for req in self.intake.alloc_round():
                if self.holds is not None and req.reuse_tokens:
                    if self.holds.pull(req):  # its hit comes from a DE: HeldCopiedMsg
                        continue
                    recompute_beyond(req, 0)
                if not self.intake.start_read(req):
                    self.passes.enqueue(req)
        finally:
            self.passes.end_round()

    @property
    def num_cancelled(self) -> int:
        return self.handlers.num_cancelled

    def _health(self) -> None:
        if self.on_health is not None:
            self.on_health(self.recovery.not_ready())

    def on_message(self, msg: Any) -> None:
        self.handlers.on_message(msg)

    # ------------------------------------------------------------------ the run
    def run(self, until: threading.Event | None = None) -> RunResult:
        """Drive every turn to the end; with ``until`` (a server), keep serving submitted
        turns until it is set, then abort what is still running."""
        try:
            return self._run(until)
        finally:
            if self._journal_file is not None:
                self._journal_file.close()

    def _busy(self) -> bool:
        return self.core.agents.busy or self.intake.live() or self.durability.busy

    def _run(self, until: threading.Event | None) -> RunResult:
        start = last_progress = self.now()
        # a server's API ends each request at request_timeout_s and cancels it: the run is
        # declared stuck (fatal) only if that did not unstick it
        timeout_s = self.env.options.request_timeout_s * (1 if until is None else 2)
        results = self.launcher.results
        while True:
            self._take_inbox()
            busy = self._busy()
            if until is not None and until.is_set():
                for rid in sorted(self.reqs):
                    self.handlers.cancel(rid)
                break
            if not busy and until is None:
                break
            if not busy:
                last_progress = self.now()  # idle is not stuck
            if self.publisher.due(self.now()):
                self._publish()
            self.handlers.recover()
            self.admit()
            self.try_alloc()
            try:
                msg = results.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                if self.now() - last_progress > timeout_s:
                    raise RuntimeFailure(
                        f"no progress for {timeout_s:g} s: the run is stuck"
                    ) from None
                continue
            last_progress = self.now()
            self.on_message(msg)
            self._drain()  # what else has arrived, before the next round
        return RunResult.build(self, start, self.now())

    def _drain(self) -> None:
        """Handle every message in the results queue now."""
        while True:
            try:
                msg = self.launcher.results.get_nowait()
            except queue.Empty:
                return
            self.on_message(msg)
