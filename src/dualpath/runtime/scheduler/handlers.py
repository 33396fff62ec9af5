"""The wiring of a turn's life in the scheduler: what it does with each message a runtime
process sends it (one method per message type: ``HANDLERS``), with a turn cut short (cancel,
abort, resubmit) and with dead processes (``recover``). Each step hands one component's
result to the next (the components never call each other). The loop (``loop.py``) owns the
rounds and the public face; this holds only the wiring over the parts the loop built
(``Parts``), and a count of cancelled turns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dualpath.ledger import Phase
from dualpath.ledger.core import Core
from dualpath.ledger.counters import RunCounters
from dualpath.ledger.topology import Topology
from dualpath.metrics.hops import hop
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
from dualpath.runtime.scheduler.decodes import Decodes
from dualpath.runtime.scheduler.durability import Durability
from dualpath.runtime.scheduler.holds import Holds, recompute_beyond
from dualpath.runtime.scheduler.inbox import Submission
from dualpath.runtime.scheduler.intake import Intake
from dualpath.runtime.scheduler.passes import Passes
from dualpath.runtime.scheduler.recovery import Recovery, resume
from dualpath.runtime.scheduler.slots import Pools, Slots
from dualpath.runtime.scheduler.streams import Streams
from dualpath.runtime.scheduler.writes import Writes
from dualpath.types import KVPath

# message type → the ``Handlers`` method that handles it (what the processes send back)
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


@dataclass(frozen=True, slots=True)
class Parts:
    """What the loop built and the handlers wire: the launcher's ports, the core (the one
    door to the ledger and the policy), the buffer slots and HBM pools, the components."""

    launcher: Launcher
    env: ProcEnv
    topo: Topology
    core: Core[AgentState, Req]
    counters: RunCounters
    reqs: dict[int, Req]
    pools: Pools
    slots: Slots
    intake: Intake
    passes: Passes
    decodes: Decodes
    durability: Durability
    writes: Writes
    recovery: Recovery
    streams: Streams
    holds: Holds | None  # d2p only
    gpu: dict[int, GpuUse]  # per engine, emulated GPU time only
    tiering: bool  # dram-tier: a PE node's worker keeps the prompt blocks its PEs computed
    now: Callable[[], float]


class Handlers:
    def __init__(
        self,
        parts: Parts,
        submit: Callable[[Submission], None],
        health: Callable[[], None],
        drain: Callable[[], None],
    ) -> None:
        self.p = parts
        self.submit = submit  # a submission (held, lost or new) goes to the intake
        self.health = health  # a process is restarting, or ready again: tell the server
        self.drain = drain  # handle every message already queued, now
        self.num_cancelled = 0
        self._handlers = {kind: getattr(self, name) for kind, name in HANDLERS.items()}

    def on_message(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise RuntimeFailure(f"scheduler: unexpected message {type(msg).__name__}")
        handler(msg)

    def _on_error(self, msg: ErrorMsg) -> None:
        raise RuntimeFailure(f"{msg.who}: {msg.text}")

    def _on_ready(self, msg: ReadyMsg) -> None:  # a respawned process can serve again
        self.p.launcher.announce_region(msg.who, msg.region)  # (an engine: a new exchange region)
        if self.p.recovery.end(msg.who):
            self.health()

    def _on_wake(self, _: WakeMsg) -> None:  # a submission or cancel: this round takes it
        pass

    def _on_persist(self, msg: PersistMsg) -> None:  # a DE's Full Block: to its node's worker
        self.p.writes.sent(msg, self._tier_node(msg))
        self.p.launcher.send_storage(msg.node, msg)

    def _tier_node(self, msg: PersistMsg) -> int:
        """``dram-tier``: the node of the PE that computed a prompt block (its tier keeps a
        copy once the block is durable); -1 otherwise."""
        req = self.p.reqs.get(msg.request_id) if self.p.tiering else None
        if req is None or req.pe < 0 or msg.block >= req.prompt_tokens // self.p.env.block_tokens:
            return -1
        return self.p.topo.node_of(req.pe)

    def _on_persisted(self, msg: PersistedMsg) -> None:
        sent = self.p.writes.acked(msg.node, msg.slot)
        if sent is None:
            return  # the second ack of a write handed on twice: the first one counted
        self.p.launcher.buffer(msg.node).free([msg.slot])
        if sent[1] >= 0 and msg.ok:
            self.p.launcher.send_storage(sent[1], TierPutMsg(msg.key))
        if not msg.ok:  # dropped (e.g. full disk): not cached, later turns recompute it
            self.p.counters.persist_failed += 1
        for item in self.p.durability.acked_key(msg.key):
            self.submit(item)
        self.p.core.agents.durable(msg.key)

    def _on_read_done(self, msg: ReadDoneMsg) -> None:
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None and self.p.intake.read_done(req, msg):
            self.p.passes.enqueue(req)

    def _on_forward_done(self, msg: ForwardDoneMsg) -> None:
        done = self.p.passes.forward_done(msg)
        if done is None:  # a pass of an engine declared dead
            return
        self.p.pools.report(msg.engine_id, msg.free_pages)
        self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
        for req, first_token in done:
            self.p.decodes.first_token(req, first_token, msg.done_s)  # (hop "sched.first_token")
            self.p.streams.emit(req, (*req.resumed, first_token), False)
            self.p.decodes.start(req)
        self.p.passes.pass_over(msg.engine_id)

    def _on_loaded(self, msg: LoadedMsg) -> None:
        self.p.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=True)
        if req is not None:
            self.p.decodes.loaded(req, self.p.now())

    def _on_tokens(self, msg: TokensMsg) -> None:  # one decode step of a DE
        self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
        for rid, lp in msg.logprobs:  # (before the tokens: a callback reads them)
            req = self.p.decodes.decoding(rid)
            if req is not None and self.p.streams.watches(rid):
                req.logprobs.append(lp)
        for req, token in self.p.decodes.step(msg):
            if self.p.streams.watches(req.request_id):
                req.streamed.append(token)
                self.p.streams.emit(req, (*req.resumed, req.first_token, *req.streamed), False)

    def _on_decode_done(self, msg: DecodeDoneMsg) -> None:
        self.p.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=False)
        if req is None:
            if self.p.holds is not None:  # aborted: whatever its DE kept goes
                self.p.launcher.send(msg.engine_id, ReleaseHeldMsg(msg.request_id))
            return
        hop("sched.decode_done", req.request_id)
        self.p.decodes.done(req, msg)
        if self.p.holds is not None:
            self._kept(req)
        # the turn's whole output, now (a resend waits for its blocks: ``Durability.hold``)
        self.p.streams.emit(req, (*req.resumed, *msg.output), True)
        pending = self.p.durability.handed(req.request_id, msg.persisted_keys)
        self.p.core.agents[req.agent_id].finish_turn(req.tokens, msg.output)
        # the next turn arrives now (tool latency 0) but is submitted once this turn's blocks
        # are durable, so its hits are what design §9 says the previous turn persisted
        self.p.core.agents.next_turn(req.agent_id, msg.finish_s, pending)

    def _kept(self, req: Req) -> None:
        """d2p: ``req``'s DE kept its pages; the ledger holds them for its agent's next turn,
        unless it could not (then they go now)."""
        assert self.p.holds is not None and self.p.core.residency is not None
        store = self.p.core.residency.stores[req.de]
        if store.peek(req.agent_id, self.p.now()):
            self.p.holds.kept(req.de, req.agent_id, req.request_id)
        else:
            self.p.launcher.send(req.de, ReleaseHeldMsg(req.request_id))

    def _on_held_copied(self, msg: HeldCopiedMsg) -> None:
        """d2p: a DE copied a hold for a turn's hits (or released one: ``request_id`` -1)."""
        self.p.pools.report(msg.engine_id, msg.free_pages)
        req = self._live(msg.request_id, free_if_aborted=True) if msg.request_id >= 0 else None
        if req is None:
            return
        recompute_beyond(req, msg.num_blocks * self.p.env.block_tokens)
        self.p.counters.moved(
            KVPath.PEER_TO_PE_HBM, msg.num_blocks * self.p.env.layout.full_block_bytes
        )
        self.p.passes.enqueue(req)

    def _live(self, request_id: int, free_if_aborted: bool) -> Req | None:
        """The turn a message is about, unless it is over (an aborted turn's slots are freed
        when ``free_if_aborted``: the message came from its last writer)."""
        req = self.p.reqs.get(request_id)
        if req is not None and req.phase.over:
            if free_if_aborted:
                self.p.slots.free(req)
            return None
        return req

    def _note_gpu(self, engine: int, emulated_s: float, host_s: float) -> None:
        """Count an engine's pass under emulated GPU time (and whether it overran)."""
        if emulated_s > 0.0:
            self.p.gpu.setdefault(engine, GpuUse()).add(emulated_s, host_s)

    # ------------------------------------------------------------------ a turn cut short
    def cancel(self, rid: int) -> None:
        """Abort ``rid`` now if its state allows, else the core aborts it when the policy
        assigns it. Slots a process may still write (a read, a pass, a DE not yet loaded)
        are freed when it reports back; a DE drops the request on ``CancelMsg``."""
        req = self.p.reqs.get(rid)
        self.p.streams.drop(rid)
        if req is None or req.phase.over:
            return
        self.num_cancelled += 1
        if not self.p.core.cancel(req, self.p.now()):  # queued: aborted when assigned
            return
        in_flight = req.phase is Phase.READING or req.phase is Phase.IN_PASS
        if req.phase is Phase.DECODING:
            in_flight = not req.loaded
            self.p.launcher.send(req.de, CancelMsg(rid))
        self._abort(req, free_now=not in_flight)
        if not in_flight:
            self.p.passes.kick(self.p.topo.group_of(req.pe))

    def _abort(self, req: Req, free_now: bool) -> None:
        self.p.core.abort(req, self.p.now())  # it leaves every counter
        self.p.durability.forget(req.request_id)
        self.p.decodes.leave(req)
        self.p.passes.drop(req)
        if free_now:
            self.p.slots.free(req)

    def _resubmit(self, req: Req) -> None:
        """Submit an aborted request again (``recovery.resume``): a streaming turn goes on
        after the tokens its client has; one they already end is finished here."""
        cb = self.p.streams.drop(req.request_id)
        agent = self.p.core.agents[req.agent_id]
        plan = resume(req, agent.context, streaming=cb is not None)
        if plan.finished:
            agent.finish_turn(req.tokens[: len(req.tokens) - len(req.resumed)], plan.resumed)
            if cb is not None:
                cb(req.request_id, plan.resumed, True)
            return
        again = self.p.intake.submit(agent, plan.append, plan.output_tokens, sampling=plan.sampling)
        again.resumed = plan.resumed
        again.logprobs = req.logprobs[: len(plan.resumed)]
        if cb is not None:
            self.p.streams.watch(again.request_id, cb)

    def recover(self) -> None:
        """Restart a dead fork server; respawn dead storage workers and engines (each killed
        and confirmed gone first); re-queue every unfinished turn that depended on a dead
        engine (``Recovery.orphans``), re-issue a dead worker's reads and writes."""
        if not self.p.recovery.due(self.p.now()):
            return
        if self.p.launcher.check_fork_server():
            self._restarting("fork-server", "died, restarted (its children serve on)")
        elif self.p.recovery.end("fork-server"):  # restarted a liveness check ago
            self.health()
        for name in self.p.launcher.dead_workers():
            self._restarting(name, "died, respawning")
            self._recover_storage(int(name.removeprefix("storage@node")))
        for e in self.p.launcher.dead_engines():
            self._restarting(self.p.topo.engine_name(e), "died, respawning")
            self.p.launcher.respawn(e)
            self.p.passes.engine_died(e)
            for req, free_now in self.p.recovery.orphans(e, self.p.reqs.values()):
                self._abort(req, free_now)
                self.p.counters.requeued += 1
                self._resubmit(req)
            self.p.pools.reset(e)  # a fresh engine: its whole pool
            self.p.passes.kick_all()

    def _restarting(self, name: str, why: str) -> None:
        if self.p.recovery.begin(name, why):
            self.health()

    def _recover_storage(self, node: int) -> None:
        """Respawn a dead storage worker (confirmed gone first). Every answer it sent is in the
        results queue by then: those are taken first, then every read and write it had not
        answered goes to its successor (the same slots: nobody else wrote them meanwhile)."""
        self.p.launcher.respawn_storage(node)
        self.drain()
        for msg in self.p.writes.outstanding(node):
            self.p.launcher.send_storage(node, msg)
        for req in self.p.intake.lost_reads(node):
            self.p.counters.requeued += 1
            self.p.intake.start_read(req, retry=True)  # the same slots: the retry overwrites them
        live = [i for i, r in self.p.reqs.items() if not r.phase.over]
        for item in self.p.durability.lost(live):
            self.submit(item)
        self.p.core.agents.release_all()
