"""The scheduler's loop: one round is recover → admit (policy pull) → buffer slots → wait for
a message, and each message type has one handler (``_handlers``) that wires the components:
``Intake`` (turns in, slots, reads), ``Passes`` (PE queues, group passes), ``Decodes`` (a
turn on its DE), ``Durability`` (acks, done-after-persist), ``Recovery`` (dead processes)
and ``Streams`` (token callbacks). They never call each other; the handlers here hand one's
result to the next. The ``Core`` keeps every counter, the view and the agent driver."""

from __future__ import annotations

import queue
import threading
from typing import Any, TextIO

from dualpath.ledger import Phase
from dualpath.ledger.core import Core
from dualpath.policy.base import Policy
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.hops import hop
from dualpath.runtime.launcher import Launcher, RuntimeFailure
from dualpath.runtime.messages import (
    DecodeDoneMsg,
    ErrorMsg,
    ForwardDoneMsg,
    LoadedMsg,
    PersistedMsg,
    PersistMsg,
    ReadDoneMsg,
    ReadyMsg,
    TokensMsg,
    WakeMsg,
)
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.result import RunResult
from dualpath.runtime.scheduler.api import SchedulerApi
from dualpath.runtime.scheduler.decodes import Decodes
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.intake import Intake
from dualpath.runtime.scheduler.passes import Passes, kv_budget_tokens
from dualpath.runtime.scheduler.recovery import Recovery
from dualpath.runtime.scheduler.slots import Pools, Slots
from dualpath.runtime.scheduler.stats import SchedulerStats
from dualpath.runtime.scheduler.streams import Streams

IDLE_WAIT_S = 0.005
# message type → the ``Scheduler`` method that handles it (what the processes send back)
HANDLERS: dict[type, str] = {
    ErrorMsg: "_on_error",
    ReadyMsg: "_on_ready",
    PersistedMsg: "_on_persisted",
    ForwardDoneMsg: "_on_forward_done",
    TokensMsg: "_on_tokens",
    ReadDoneMsg: "_on_read_done",
    LoadedMsg: "_on_loaded",
    DecodeDoneMsg: "_on_decode_done",
    WakeMsg: "_on_wake",
}


class Scheduler(SchedulerApi):
    def __init__(self, launcher: Launcher, env: ProcEnv, policy: Policy) -> None:
        self.launcher, self.env, self.policy = launcher, env, policy
        self.topo = topo = env.topology
        self.block = block = env.block_tokens
        self.layerwise = layerwise = bool(getattr(policy, "layerwise", True))
        num_layers = env.config.model.num_layers
        # every engine's HBM pool: pages of one Layer Block; engines report their free pages
        pages = env.options.hbm_pages(num_layers, block)  # a DE's
        pe_pages = env.options.hbm_pages(num_layers, block, pe=True)
        self.core: Core[AgentState] = Core(
            topo, policy, pages // num_layers * block, block, self._next_turn
        )
        self.core.count_generated()
        self.ledger, self.events, self.counters = (
            self.core.ledger,
            self.core.events,
            self.core.counters,
        )
        self.pools = Pools(self.ledger, topo, pages, pe_pages, num_layers, block)
        self.slots = Slots(launcher, topo, block)
        self.intake = Intake(env, self.ledger, policy, self.slots, self.counters, pages, self.now)
        self.reqs: dict[int, Req] = self.intake.reqs
        self.passes = Passes(
            topo, self.ledger, policy, launcher, self.slots, self.reqs, self.counters,
            self.events, lambda p: kv_budget_tokens(p, pe_pages, num_layers, block, layerwise),
            layerwise, env.options.batching, self.now,
        )  # fmt: skip
        full = env.layout.full_block_bytes
        self.decodes = Decodes(self.core, topo, self.slots, launcher, self.reqs, block, full)
        self.durability = Durability()
        self.recovery = Recovery()
        self.streams = Streams()
        self.gpu: dict[int, GpuUse] = {}  # per engine, emulated GPU time only
        self._journal_file: TextIO | None = None  # record_ledger's output
        self._external: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.num_cancelled = 0
        self.rejected: list[str] = []  # turns rejected alone (one line each)
        self.stats = SchedulerStats()  # the last published snapshot (``publish_stats``)
        self._stats_every_s: float | None = None
        self._stats_at_s = float("-inf")
        self._handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}

    @staticmethod
    def handled_messages() -> tuple[type, ...]:
        """The message types the run loop handles (one handler each)."""
        return tuple(HANDLERS)

    def now(self) -> float:
        return self.env.clock.now()

    # ------------------------------------------------------------------ one round
    def schedule(self) -> None:
        """A pull: the policy's assignments wait for their buffer slots."""
        self.intake.admit()

    def try_alloc(self) -> None:
        """Give waiting turns their slots, FIFO, and start their reads; turns with nothing to
        read join their PE's queue, each group's next pass planned after the whole round."""
        self.passes.begin_round()
        try:
            for req in self.intake.alloc_round():
                if not self.intake.start_read(req):
                    self.passes.enqueue(req)
        finally:
            self.passes.end_round()

    def kick(self, group: int) -> None:
        self.passes.kick(group)

    def recover(self) -> None:
        """Respawn dead storage workers and engines; re-queue every unfinished turn that
        depended on a dead engine (``Recovery.orphans``), re-issue a dead worker's reads."""
        if not self.recovery.due(self.now()):
            return
        for name in self.launcher.dead_workers():
            self._recover_storage(int(name.removeprefix("storage@node")))
        for e in self.launcher.dead_engines():
            self.launcher.respawn(e)
            self.passes.engine_died(e)
            for req, free_now in self.recovery.orphans(e, self.reqs.values()):
                self._abort(req, free_now)
                self.counters.requeued += 1
                self._resubmit(req)
            self.pools.reset(e)  # a fresh engine: its whole pool
            self.passes.kick_all()

    def _recover_storage(self, node: int) -> None:
        """Respawn a dead storage worker; re-issue its reads and its queued writes. Writes it
        had already taken are lost: their keys are treated as not cached (the turns waiting on
        them go ahead and recompute what is missing)."""
        inbox = self.env.storage_inboxes[node]
        for msg in self.launcher.respawn_storage(node):
            if isinstance(msg, PersistMsg):
                inbox.put(msg)
        for req in self.intake.lost_reads(node):
            self.counters.requeued += 1
            self.intake.start_read(req, retry=True)  # the same slots: the retry overwrites them
        live = [i for i, r in self.reqs.items() if r.phase not in (Phase.DONE, Phase.ABORTED)]
        for item in self.durability.lost(live):
            self._submit_external(item)
        self.core.agents.release_all()

    # ------------------------------------------------------------------ handlers
    def on_message(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise RuntimeFailure(f"scheduler: unexpected message {type(msg).__name__}")
        handler(msg)

    def _on_error(self, msg: ErrorMsg) -> None:
        raise RuntimeFailure(f"{msg.who}: {msg.text}")

    def _on_ready(self, msg: ReadyMsg) -> None:  # a respawned engine: its exchange region is new
        self.launcher.announce_region(msg.who, msg.region)

    def _on_persisted(self, msg: PersistedMsg) -> None:
        if not msg.ok:  # dropped (e.g. full disk): not cached, later turns recompute it
            self.counters.persist_failed += 1
        for item in self.durability.acked_key(msg.key):
            self._submit_external(item)
        self.core.agents.durable(msg.key)

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

    def _live(self, request_id: int, free_if_aborted: bool) -> Req | None:
        """The turn a message is about, unless it is over (an aborted turn's slots are freed
        when ``free_if_aborted``: the message came from its last writer)."""
        req = self.reqs.get(request_id)
        if req is not None and req.phase in (Phase.ABORTED, Phase.DONE):
            if free_if_aborted:
                self.slots.free(req)
            return None
        return req

    def _on_read_done(self, msg: ReadDoneMsg) -> None:
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None and self.intake.read_done(req, msg):
            self.passes.enqueue(req)

    def _on_loaded(self, msg: LoadedMsg) -> None:
        self.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None:
            self.decodes.loaded(req, self.now())

    def _on_decode_done(self, msg: DecodeDoneMsg) -> None:
        self.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=False)
        if req is None:
            return
        hop("sched.decode_done", req.request_id)
        self.decodes.done(req, msg)
        # the turn's whole output, now (a resend waits for its blocks: ``Durability.hold``)
        self.streams.emit(req, (*req.resumed, *msg.output), True)
        pending = self.durability.handed(req.request_id, msg.persisted_keys)
        self.core.agents[req.agent_id].finish_turn(req.tokens, msg.output)
        # the next turn arrives now (tool latency 0) but is submitted once this turn's blocks
        # are durable, so its hits are what SPEC §9 says the previous turn persisted
        self.core.agents.next_turn(req.agent_id, msg.finish_s, pending)

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
            self._drain_external()
            busy = self._busy()
            if until is not None and until.is_set():
                for rid in sorted(self.reqs):
                    self._cancel(rid)
                break
            if not busy and until is None:
                break
            if not busy:
                last_progress = self.now()  # idle is not stuck
            if self._stats_every_s is not None and (
                self.now() - self._stats_at_s >= self._stats_every_s
            ):
                self._publish()
            self.recover()
            self.schedule()
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
            while True:  # drain what else has arrived before the next round
                try:
                    self.on_message(results.get_nowait())
                except queue.Empty:
                    break
        return RunResult.build(self, start, self.now())
