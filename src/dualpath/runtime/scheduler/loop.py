"""The scheduler: a loop over components that own their state, and the handlers that wire them.

One round is: take what other threads queued (``Inbox``) → recover dead processes → a pull
(the policy's assignments, through the ``Core``) → buffer slots and reads → wait for a
message; each message type has one handler (``HANDLERS``). The components — ``Intake``
(turns in, the slot queue, reads), ``Passes`` (PE queues, group passes), ``Decodes`` (a turn
on its DE), ``Durability`` (acks, resends held for blocks in flight), ``Recovery`` (dead
processes), ``Streams`` (token callbacks), ``Inbox`` (other threads' submissions) — never call
each other (``tests/runtime/test_scheduler_parts.py``): a handler here hands one's result to
the next. They share the ``Core`` (the one door to the ledger and the policy: every
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
from dualpath.metrics.hops import hop
from dualpath.policy import ClusterView
from dualpath.policy.base import Policy
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.launcher import Launcher, RuntimeFailure
from dualpath.runtime.messages import (
    CancelMsg,
    DecodeDoneMsg,
    ErrorMsg,
    ForwardDoneMsg,
    HeldCopiedMsg,
    LoadedMsg,
    PersistedMsg,
    PersistMsg,
    ReadDoneMsg,
    ReadyMsg,
    ReleaseHeldMsg,
    TierPutMsg,
    TokensMsg,
    WakeMsg,
)
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.result import RunResult
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.decodes import Decodes
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.holds import Holds, d2p_residency
from dualpath.runtime.scheduler.inbox import Inbox, Submission
from dualpath.runtime.scheduler.intake import Intake
from dualpath.runtime.scheduler.passes import Passes, kv_budget_tokens
from dualpath.runtime.scheduler.recovery import Recovery, resume
from dualpath.runtime.scheduler.slots import Pools, Slots
from dualpath.runtime.scheduler.stats import STATS_PUBLISH_S, Publisher, SchedulerStats, snapshot
from dualpath.runtime.scheduler.streams import Streams, TokenCallback
from dualpath.runtime.scheduler.writes import Writes
from dualpath.types import KVPath

IDLE_WAIT_S = 0.005
# message type → the ``Scheduler`` method that handles it (what the processes send back)
HANDLERS: dict[type, str] = {
    ErrorMsg: "_on_error",
    ReadyMsg: "_on_ready",
    PersistMsg: "_on_persist",
    PersistedMsg: "_on_persisted",
    ForwardDoneMsg: "_on_forward_done",
    TokensMsg: "_on_tokens",
    ReadDoneMsg: "_on_read_done",
    LoadedMsg: "_on_loaded",
    DecodeDoneMsg: "_on_decode_done",
    HeldCopiedMsg: "_on_held_copied",
    WakeMsg: "_on_wake",
}


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
        # dram-tier: every node's storage worker keeps a DRAM tier (kv.tier), and a PE
        # node's also keeps the prompt blocks its PEs computed (``TierPutMsg``)
        self.tiering = env.options.spec.reuse == "dram-tier"
        self.recovery = Recovery()
        # called on this thread with why the runtime is not ready ("" : ready again) each time
        # that changes: a process is being restarted, or every restarted one acked
        self.on_health: Callable[[str], None] | None = None
        self.streams = Streams()
        self.inbox = Inbox(lambda: launcher.results.put(WakeMsg()))
        self.publisher = Publisher()
        self.gpu: dict[int, GpuUse] = {}  # per engine, emulated GPU time only
        self.num_cancelled = 0
        self.rejected: list[str] = []  # turns rejected alone (one line each)
        self._journal_file: TextIO | None = None  # record_ledger's output
        self._handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}

    @staticmethod
    def handled_messages() -> tuple[type, ...]:
        """The message types the run loop handles (one handler each)."""
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

    @property
    def read_q(self) -> list[int]:
        """Hit tokens queued or being read per node (the ledger's read_q)."""
        return self.core.read_q

    def view(self) -> ClusterView:
        """What the engines report at a pull (the ledger's view)."""
        return self.core.view()

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
                self.num_cancelled,
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
            self._cancel(rid)
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

    # ------------------------------------------------------------------ aborts
    def _cancel(self, rid: int) -> None:
        """Abort ``rid`` now if its state allows, else the core aborts it when the policy
        assigns it. Slots a process may still write (a read, a pass, a DE not yet loaded)
        are freed when it reports back; a DE drops the request on ``CancelMsg``."""
        req = self.reqs.get(rid)
        self.streams.drop(rid)
        if req is None or req.phase.over:
            return
        self.num_cancelled += 1
        if not self.core.cancel(req, self.now()):  # queued: aborted when assigned
            return
        in_flight = req.phase is Phase.READING or req.phase is Phase.IN_PASS
        if req.phase is Phase.DECODING:
            in_flight = not req.loaded
            self.launcher.send(req.de, CancelMsg(rid))
        self._abort(req, free_now=not in_flight)
        if not in_flight:
            self.passes.kick(self.topo.group_of(req.pe))

    def _abort(self, req: Req, free_now: bool) -> None:
        self.core.abort(req, self.now())  # it leaves every counter
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
        again = self.submit_turn(
            req.agent_id, plan.append, plan.output_tokens, sampling=plan.sampling
        )
        again.resumed = plan.resumed
        again.logprobs = req.logprobs[: len(plan.resumed)]
        if cb is not None:
            self.streams.watch(again.request_id, cb)

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
                    self._recompute_hit(req, 0)
                if not self.intake.start_read(req):
                    self.passes.enqueue(req)
        finally:
            self.passes.end_round()

    def kick(self, group: int) -> None:
        self.passes.kick(group)

    def recover(self) -> None:
        """Restart a dead fork server; respawn dead storage workers and engines (each killed
        and confirmed gone first); re-queue every unfinished turn that depended on a dead
        engine (``Recovery.orphans``), re-issue a dead worker's reads and writes."""
        if not self.recovery.due(self.now()):
            return
        if self.launcher.check_fork_server():
            self._restarting("fork-server", "died, restarted (its children serve on)")
        elif self.recovery.end("fork-server"):  # restarted a liveness check ago
            self._health()
        for name in self.launcher.dead_workers():
            self._restarting(name, "died, respawning")
            self._recover_storage(int(name.removeprefix("storage@node")))
        for e in self.launcher.dead_engines():
            self._restarting(self.topo.engine_name(e), "died, respawning")
            self.launcher.respawn(e)
            self.passes.engine_died(e)
            for req, free_now in self.recovery.orphans(e, self.reqs.values()):
                self._abort(req, free_now)
                self.counters.requeued += 1
                self._resubmit(req)
            self.pools.reset(e)  # a fresh engine: its whole pool
            self.passes.kick_all()

    def _restarting(self, name: str, why: str) -> None:
        if self.recovery.begin(name, why):
            self._health()

    def _health(self) -> None:
        if self.on_health is not None:
            self.on_health(self.recovery.not_ready())

    def _recover_storage(self, node: int) -> None:
        """Respawn a dead storage worker (confirmed gone first). Every answer it sent is in the
        results queue by then: those are taken first, then every read and write it had not
        answered goes to its successor (the same slots: nobody else wrote them meanwhile)."""
        self.launcher.respawn_storage(node)
        self._drain()
        for msg in self.writes.outstanding(node):
            self.launcher.send_storage(node, msg)
        for req in self.intake.lost_reads(node):
            self.counters.requeued += 1
            self.intake.start_read(req, retry=True)  # the same slots: the retry overwrites them
        live = [i for i, r in self.reqs.items() if not r.phase.over]
        for item in self.durability.lost(live):
            self._submit(item)
        self.core.agents.release_all()

    # ------------------------------------------------------------------ handlers
    def on_message(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise RuntimeFailure(f"scheduler: unexpected message {type(msg).__name__}")
        handler(msg)

    def _on_error(self, msg: ErrorMsg) -> None:
        raise RuntimeFailure(f"{msg.who}: {msg.text}")

    def _on_ready(self, msg: ReadyMsg) -> None:  # a respawned process can serve again
        self.launcher.announce_region(msg.who, msg.region)  # (an engine: a new exchange region)
        if self.recovery.end(msg.who):
            self._health()

    def _on_wake(self, _: WakeMsg) -> None:  # a submission or cancel: this round takes it
        pass

    def _on_persist(self, msg: PersistMsg) -> None:  # a DE's Full Block: to its node's worker
        self.writes.sent(msg, self._tier_node(msg))
        self.launcher.send_storage(msg.node, msg)

    def _tier_node(self, msg: PersistMsg) -> int:
        """``dram-tier``: the node of the PE that computed a prompt block (its tier keeps a
        copy once the block is durable); -1 otherwise."""
        req = self.reqs.get(msg.request_id) if self.tiering else None
        if req is None or req.pe < 0 or msg.block >= req.prompt_tokens // self.env.block_tokens:
            return -1
        return self.topo.node_of(req.pe)

    def _on_persisted(self, msg: PersistedMsg) -> None:
        sent = self.writes.acked(msg.node, msg.slot)
        if sent is None:
            return  # the second ack of a write handed on twice: the first one counted
        self.launcher.buffer(msg.node).free([msg.slot])
        if sent[1] >= 0 and msg.ok:
            self.launcher.send_storage(sent[1], TierPutMsg(msg.key))
        if not msg.ok:  # dropped (e.g. full disk): not cached, later turns recompute it
            self.counters.persist_failed += 1
        for item in self.durability.acked_key(msg.key):
            self._submit(item)
        self.core.agents.durable(msg.key)

    def _on_read_done(self, msg: ReadDoneMsg) -> None:
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None and self.intake.read_done(req, msg):
            self.passes.enqueue(req)

    def _on_forward_done(self, msg: ForwardDoneMsg) -> None:
        done = self.passes.forward_done(msg)
        if done is None:  # a pass of an engine declared dead
            return
        self.pools.report(msg.engine_id, msg.free_pages)
        self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
        for req, first_token in done:
            self.decodes.first_token(req, first_token, msg.done_s)  # (hop "sched.first_token")
            self.streams.emit(req, (*req.resumed, first_token), False)
            self.decodes.start(req)
        self.passes.pass_over(msg.engine_id)

    def _on_loaded(self, msg: LoadedMsg) -> None:
        self.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None:
            self.decodes.loaded(req, self.now())

    def _on_tokens(self, msg: TokensMsg) -> None:  # one decode step of a DE
        self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
        for rid, lp in msg.logprobs:  # (before the tokens: a callback reads them)
            req = self.decodes.decoding(rid)
            if req is not None and self.streams.watches(rid):
                req.logprobs.append(lp)
        for req, token in self.decodes.step(msg):
            if self.streams.watches(req.request_id):
                req.streamed.append(token)
                self.streams.emit(req, (*req.resumed, req.first_token, *req.streamed), False)

    def _on_decode_done(self, msg: DecodeDoneMsg) -> None:
        self.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=False)
        if req is None:
            if self.holds is not None:  # aborted: whatever its DE kept goes
                self.launcher.send(msg.engine_id, ReleaseHeldMsg(msg.request_id))
            return
        hop("sched.decode_done", req.request_id)
        self.decodes.done(req, msg)
        if self.holds is not None:
            self._kept(req)
        # the turn's whole output, now (a resend waits for its blocks: ``Durability.hold``)
        self.streams.emit(req, (*req.resumed, *msg.output), True)
        pending = self.durability.handed(req.request_id, msg.persisted_keys)
        self.core.agents[req.agent_id].finish_turn(req.tokens, msg.output)
        # the next turn arrives now (tool latency 0) but is submitted once this turn's blocks
        # are durable, so its hits are what design §9 says the previous turn persisted
        self.core.agents.next_turn(req.agent_id, msg.finish_s, pending)

    def _kept(self, req: Req) -> None:
        """d2p: ``req``'s DE kept its pages; the ledger holds them for its agent's next turn,
        unless it could not (then they go now)."""
        assert self.holds is not None and self.core.residency is not None
        store = self.core.residency.stores[req.de]
        if store.peek(req.agent_id, self.now()):
            self.holds.kept(req.de, req.agent_id, req.request_id)
        else:
            self.launcher.send(req.de, ReleaseHeldMsg(req.request_id))

    def _on_held_copied(self, msg: HeldCopiedMsg) -> None:
        """d2p: a DE copied a hold for a turn's hits (or released one: ``request_id`` -1)."""
        self.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=True) if msg.request_id >= 0 else None
        if req is None:
            return
        self._recompute_hit(req, msg.num_blocks * self.env.block_tokens)
        self.counters.moved(
            KVPath.PEER_TO_PE_HBM, msg.num_blocks * self.env.layout.full_block_bytes
        )
        self.passes.enqueue(req)

    def _recompute_hit(self, req: Req, tokens: int) -> None:
        """``req``'s hit KV is its first ``tokens`` (what a hold gave it): the rest of its
        hit is computed again (a hold lost to a DE restart; the tokens are the same)."""
        req.cached = min(tokens, req.hit_tokens)
        if req.cached < req.hit_tokens:
            req.hit_tokens = req.kv_tokens = req.cached

    def _live(self, request_id: int, free_if_aborted: bool) -> Req | None:
        """The turn a message is about, unless it is over (an aborted turn's slots are freed
        when ``free_if_aborted``: the message came from its last writer)."""
        req = self.reqs.get(request_id)
        if req is not None and req.phase.over:
            if free_if_aborted:
                self.slots.free(req)
            return None
        return req

    def _note_gpu(self, engine: int, emulated_s: float, host_s: float) -> None:
        """Count an engine's pass under emulated GPU time (and whether it overran)."""
        if emulated_s > 0.0:
            self.gpu.setdefault(engine, GpuUse()).add(emulated_s, host_s)

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
                    self._cancel(rid)
                break
            if not busy and until is None:
                break
            if not busy:
                last_progress = self.now()  # idle is not stuck
            if self.publisher.due(self.now()):
                self._publish()
            self.recover()
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
