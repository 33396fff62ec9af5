"""The scheduler process: hosts the policy core and drives every turn through the processes.

Turn life: submit (hit tokens from the KV store's hash chain) → policy ``schedule`` (PE, DE,
read side) → buffer slots (wait if full: backpressure) → storage read into the PE or DE
buffer → the PE's local queue → forward passes packed by ``policy.plan_forward`` (an EP
group's PEs in lockstep; a request may take several chunks) → DE batched decode, persist →
next turn of the agent. It reports each of these steps, and what the engines report (free HBM
pages, tokens generated), to the ``Ledger``, which keeps the counters (SPEC §13.4), builds the
view the policy pulls and the turn records, and emits the typed events observers subscribe to
(``self.events``), as in the simulator. It re-queues the requests of an engine process that
dies. The clock is read only through ``self.now``.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from dualpath.ledger import (
    EventBus,
    ForwardDone,
    ForwardStarted,
    Ledger,
    Persisted,
    TurnDone,
)
from dualpath.ledger.turn import Phase
from dualpath.metrics import TurnRecord
from dualpath.policy import ClusterView, PendingPrefill
from dualpath.policy.base import Policy
from dualpath.policy.commands import ForwardBatch
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import GpuUse
from dualpath.runtime.kvstore import KVStore, block_keys
from dualpath.runtime.launcher import Launcher, RuntimeFailure
from dualpath.runtime.messages import (
    CancelMsg,
    ChunkWork,
    DecodeDoneMsg,
    DecodeMsg,
    ErrorMsg,
    ExchangePlan,
    ForwardDoneMsg,
    ForwardMsg,
    LoadedMsg,
    PersistedMsg,
    PersistMsg,
    ReadDoneMsg,
    ReadMsg,
    ReadyMsg,
    TokensMsg,
)
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.result import RunResult
from dualpath.runtime.sampling import SamplingParams
from dualpath.types import EngineKind, ReadSide

IDLE_WAIT_S = 0.005
LIVENESS_CHECK_S = 0.05  # how often the run loop looks for dead children (not every round)

# on_tokens(request_id, tokens so far, done): the first token when prefill ends, then each
# decode step's with ``RuntimeOptions.stream_tokens``, then all (done)
TokenCallback = Callable[[int, tuple[int, ...], bool], None]


@dataclass(slots=True)
class _Counters:
    pe_read_bytes: int = 0
    de_read_bytes: int = 0
    layer_in_bytes: int = 0
    pd_bytes: int = 0
    h2d_bytes: int = 0
    persisted_blocks: int = 0
    persist_failed: int = 0  # block writes dropped after failing (e.g. ENOSPC): not cached
    requeued: int = 0
    alloc_stalls: int = 0  # times a request found its buffer full and waited
    passes: int = 0  # PE forward passes
    pass_chunks: int = 0  # chunks over all passes (mean batch = pass_chunks / passes)
    chunked: int = 0  # chunks that were not a request's last
    max_pass_tokens: int = 0  # most cached + new tokens resident in one pass
    pass_new_tokens: int = 0  # tokens computed by all passes
    pass_busy_s: float = 0.0  # Σ pass durations as the PEs measured them
    read_windows: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    gpu: dict[int, GpuUse] = field(default_factory=dict)  # per engine, emulated GPU time only


class Scheduler:
    def __init__(self, launcher: Launcher, env: ProcEnv, policy: Policy) -> None:
        self.launcher = launcher
        self.env = env
        self.policy = policy
        self.topo = env.topology
        self.store: KVStore = env.store()
        self.block = env.block_tokens
        self.layerwise = bool(getattr(policy, "layerwise", True))
        self.num_layers = env.config.model.num_layers
        # every engine's HBM pool: pages of one Layer Block; engines report their free pages
        self.hbm_pages = env.options.hbm_pages(self.num_layers, self.block)  # a DE's
        self.pe_hbm_pages = env.options.hbm_pages(self.num_layers, self.block, pe=True)
        self.events = EventBus()  # what happened, for observers (records, progress, metrics)
        self.records: list[TurnRecord] = []
        self.events.subscribe(TurnDone, lambda ev: self.records.append(ev.record))
        self.ledger = Ledger(self.topo, self._pool_tokens(self.hbm_pages), self.block, self.events)
        self.generated = dict.fromkeys(self.topo.de_ids, 0)  # per DE, by its admitted requests
        for _, members in self.topo.groups(EngineKind.DE):
            self.ledger.track_decode(members, self._generated_fn(members))
        self.free_pages: dict[int, int] = {}  # every engine's free HBM pages, as last reported
        for e in self.topo.engine_ids:
            self._report_free(e, self._pool_pages(e))
        self.pe_queue: dict[int, list[int]] = {e: [] for e in self.topo.pe_ids}
        self.in_pass: dict[int, ForwardBatch] = {}  # PE → its pass in flight
        self.groups: dict[int, list[int]] = {}
        for e in self.topo.pe_ids:
            self.groups.setdefault(self.topo.group_of(e), []).append(e)
        self.reqs: dict[int, Req] = {}
        self.agents: dict[int, AgentState] = {}
        self.alloc_wait: list[int] = []
        self.next_rid = 0
        self.counters = _Counters()
        self._journal_file: TextIO | None = None  # record_ledger's output
        # block keys whose write the storage workers acknowledged, written or dropped (a
        # failed write's ack may arrive before the DE's DecodeDoneMsg: it must still count)
        self.acked: set[str] = set()
        self.unpersisted: dict[int, tuple[set[str], float]] = {}  # agent → (keys, arrival_s)
        # turns submitted from other threads (a server); drained by the run loop
        self._external: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.token_callbacks: dict[int, TokenCallback] = {}
        self.num_cancelled = 0
        # rid → (keys not yet durable, request, output): done reported once they are
        self.done_after_persist: dict[int, tuple[set[str], Req, tuple[int, ...]]] = {}
        self.rejected: list[str] = []  # turns rejected alone (one line each)
        self.next_pass_id = 0  # ids of group passes (the exchange's sequence numbers)
        self._deferred_kicks: set[int] | None = None  # groups to kick after try_alloc's round
        # group → (start, batches) of its pass in flight, for ForwardStarted / ForwardDone
        self.group_pass: dict[int, tuple[float, Any]] = {}
        self._liveness_checked_s = float("-inf")  # when ``recover`` last looked

    def now(self) -> float:
        return self.env.clock.now()

    def _pool_pages(self, engine: int) -> int:
        return self.pe_hbm_pages if self.topo.is_pe(engine) else self.hbm_pages

    def _pool_tokens(self, pages: int) -> int:
        """KV tokens that fit in ``pages`` free pages (a page is one layer of one block)."""
        return pages // self.num_layers * self.block

    def _generated_fn(self, members: tuple[int, ...]) -> Callable[[], list[int]]:
        """Tokens generated so far by each member DE's admitted requests (its TokensMsgs)."""
        generated = self.generated
        return lambda: [generated[e] for e in members]

    def _report_free(self, engine: int, pages: int) -> None:
        self.free_pages[engine] = pages
        self.ledger.report_free_hbm(engine, self._pool_tokens(pages))

    @property
    def read_q(self) -> list[int]:
        """Hit tokens queued or being read per node (the ledger's read_q)."""
        return list(self.ledger.read_q)

    # ------------------------------------------------------------------ submission
    def add_agent(self, agent: AgentState) -> None:
        self.agents[agent.agent_id] = agent

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
        agent = self.agents.get(agent_id)
        if agent is None:
            raise ValueError(f"request for agent {agent_id} is invalid: unknown agent")
        if not append:
            raise ValueError(f"request for agent {agent_id} is invalid: empty prompt append")
        if output_tokens < 1:
            raise ValueError(
                f"request for agent {agent_id}: output_tokens={output_tokens} must be >= 1"
            )
        vocab = self.env.config.model.vocab_size
        if any(not 0 <= t < vocab for t in append):
            raise ValueError(f"request for agent {agent_id}: token ids must be in 0..{vocab - 1}")
        tokens = (*agent.context, *append)
        limit = self.env.config.model.max_context_tokens
        if len(tokens) + output_tokens > limit:
            raise ValueError(
                f"request for agent {agent_id} is invalid: {len(tokens)} prompt + {output_tokens} "
                f"output tokens exceed the model's context limit of {limit}"
            )
        pages = -(-(len(tokens) + output_tokens) // self.block) * self.num_layers
        if pages > self.hbm_pages:
            raise ValueError(
                f"request for agent {agent_id} is invalid: {len(tokens)} prompt + {output_tokens} "
                f"output tokens exceed an engine's HBM pool of {self.hbm_pages // self.num_layers * self.block} tokens"
            )
        namespace = self.env.namespace_for(agent.tenant or self.env.options.tenant)
        keys = block_keys(tokens, self.block, namespace)
        hit = min(self.store.lookup(keys), (len(tokens) - 1) // self.block * self.block)
        arrival = self.now() if arrival_s is None else arrival_s
        req = Req(self.next_rid, agent_id, agent.turn, tokens, output_tokens, tuple(keys), hit,
                  arrival, sampling=sampling, namespace=namespace)  # fmt: skip
        self.next_rid += 1
        self.reqs[req.request_id] = req
        self.policy.submit(self.ledger.submit(req, arrival), arrival)
        return req

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
        return fut

    def cancel_threadsafe(self, request_id: int) -> None:
        """Abort request ``request_id`` from any thread (its client is gone): its callback
        gets no more tokens; buffer slots and HBM are freed once no process writes them."""
        self._cancels.put(request_id)

    def _drain_external(self) -> None:
        while True:
            try:
                rid = self._cancels.get_nowait()
            except queue.Empty:
                break
            self._cancel(rid)
        while True:
            try:
                agent, append, output_tokens, on_tokens, fut, sampling = self._external.get_nowait()
            except queue.Empty:
                return
            self.agents.setdefault(agent.agent_id, agent)
            try:
                req = self.submit_turn(agent.agent_id, append, output_tokens, sampling=sampling)
            except ValueError as err:
                fut.set_exception(err)
                continue
            if on_tokens is not None:
                self.token_callbacks[req.request_id] = on_tokens
            fut.set_result(req.request_id)

    def forget(self, rid: int) -> None:
        """Drop a finished request and its agent once no message can refer to them (a
        server's long run); on the scheduler's thread only (e.g. from a submit callback)."""
        req = self.reqs.get(rid)
        if req is not None and req.phase is Phase.DONE:
            del self.reqs[rid]
            agent = self.agents.get(req.agent_id)
            if agent is not None and agent.finished and req.agent_id not in self.unpersisted:
                del self.agents[req.agent_id]

    def _cancel(self, rid: int) -> None:
        """Abort ``rid`` now if its phase allows, else mark it (aborted when scheduled). Slots
        a process may still write (a read, a pass, a DE not yet loaded) are freed when it
        reports back; a DE drops the request on ``CancelMsg``."""
        req = self.reqs.get(rid)
        self.token_callbacks.pop(rid, None)
        if req is None or req.phase in (Phase.DONE, Phase.ABORTED):
            return
        self.num_cancelled += 1
        if req.phase is Phase.QUEUED:  # the policy still holds it: aborted when it assigns it
            req.cancelled = True
            return
        in_flight = req.reading or req.in_pass
        if req.phase is Phase.DECODING:
            in_flight = not req.loaded
            self.launcher.engine_inbox[req.de].put(CancelMsg(rid))
        self._abort(req, free_now=not in_flight)
        if not in_flight:
            self.kick(self.topo.group_of(req.pe))

    def _emit(self, req: Req, tokens: tuple[int, ...], done: bool) -> None:
        cb = self.token_callbacks.get(req.request_id)
        if cb is not None:
            cb(req.request_id, tokens, done)
            if done:
                del self.token_callbacks[req.request_id]

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
            agent = self.agents[agent_id]
            self.rejected.append(f"agent {agent_id} turn {agent.turn}: {err}")
            print(f"dualpath: turn rejected: {self.rejected[-1]}", file=sys.stderr)
            agent.turn = len(agent.appends)
            return None

    # ------------------------------------------------------------------ view and scheduling
    def view(self) -> ClusterView:
        """What the engines report at a pull (the ledger's view)."""
        return self.ledger.view()

    def schedule(self) -> None:
        if not self.policy.num_waiting:
            return
        now = self.now()
        for a in self.ledger.pull(self.policy, now):
            req = self.reqs[a.request_id]
            reads = self.ledger.assign(req, a, now)
            if reads:  # one read: the runtime does not split reads
                (req.read_node, _), *rest = reads
                assert not rest, "split reads reached the runtime"
            if req.cancelled:  # its client left while it waited in the policy's queue
                self._abort(req, free_now=True)
                continue
            self.alloc_wait.append(req.request_id)

    def try_alloc(self) -> None:
        """Give waiting requests their buffer slots, FIFO; a request that does not fit waits.
        Requests with nothing to read join their PE's queue at once, and each group's next
        pass is planned after the whole round, so requests ready together are batched
        together (not the first alone)."""
        still: list[int] = []
        self._deferred_kicks = set()
        try:
            for rid in self.alloc_wait:
                req = self.reqs[rid]
                if req.phase is Phase.ABORTED:
                    continue
                if not self._alloc(req):
                    self.counters.alloc_stalls += 1
                    still.append(rid)
                    continue
                self._start_read(req)
        finally:
            groups, self._deferred_kicks = self._deferred_kicks, None
            self.alloc_wait = still
        for group in sorted(groups):
            self.kick(group)

    def _alloc(self, req: Req) -> bool:
        de_buf = self.launcher.buffers[self.topo.node_of(req.de)]
        need = -(-len(req.tokens) // self.block)
        # keep one slot per DE of the node free for its persists, so a DE never waits on
        # slots that only its own next request would release
        if need + self.topo.gpus_per_node > de_buf.spec.num_slots:
            raise ValueError(
                f"request {req.request_id}: {need} DE buffer slots (+{self.topo.gpus_per_node} for "
                f"persists) can never fit a buffer of {de_buf.spec.num_slots}: raise the buffer size"
            )
        if de_buf.num_free < need + self.topo.gpus_per_node:
            return False
        de_slots = de_buf.alloc(need)
        if de_slots is None:
            return False
        pe_slots: list[int] = []
        if req.read_side is ReadSide.PE:
            got = self.launcher.buffers[self.topo.node_of(req.pe)].alloc(
                req.hit_tokens // self.block
            )
            if got is None:
                de_buf.free(de_slots)
                return False
            pe_slots = got
        req.de_slots, req.pe_slots = de_slots, pe_slots
        return True

    def _start_read(self, req: Req, retry: bool = False) -> None:
        """Send the request's storage read (``retry``: again, after a storage respawn), or
        queue it on its PE at once when it has nothing to read."""
        if req.read_side is ReadSide.NONE:
            self._enqueue(req)
            return
        nblocks = req.hit_tokens // self.block
        if not retry:
            full = self.env.layout.full_block_bytes
            self.ledger.read_started(req, req.read_node, nblocks * full, self.now())
        req.reading = True
        slots = req.pe_slots if req.read_side is ReadSide.PE else req.de_slots
        self.env.storage_inboxes[req.read_node].put(
            ReadMsg(req.request_id, req.keys[:nblocks], tuple(slots[:nblocks]))
        )

    def _read_done(self, req: Req, num_ok: int, done_s: float) -> None:
        req.reading = False
        req.cached = req.hit_tokens = num_ok * self.block  # what was read and verified
        nbytes = num_ok * self.env.layout.full_block_bytes
        if req.read_side is ReadSide.PE:
            self.counters.pe_read_bytes += nbytes
        else:
            self.counters.de_read_bytes += nbytes
        self.ledger.read_done(req, req.read_node, max(done_s, req.read_start_s))
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """The request's hit KV is in a buffer: it joins its PE's local queue."""
        req.kv_tokens = req.cached
        self.pe_queue[req.pe].append(req.request_id)
        if self._deferred_kicks is not None:  # inside try_alloc's round: kicked after it
            self._deferred_kicks.add(self.topo.group_of(req.pe))
        else:
            self.kick(self.topo.group_of(req.pe))

    # ------------------------------------------------------------------ forward passes
    def kv_budget_tokens(self, pending: tuple[PendingPrefill, ...]) -> int:
        """Cached + new tokens one pass may hold: Basic holds every layer of the batch,
        layerwise two layers (one computing, the next loading). A page is a Layer Block, so
        each chunk of the pass may waste up to one page per layer: the budget keeps back one
        page per chunk the pass can hold (the queue's FIFO prefix that fits, plus one chunked
        request), the fewest that is still safe."""
        window = min(2, self.num_layers) if self.layerwise else self.num_layers
        pages = self.pe_hbm_pages // window
        for reserve in range(len(pending) + 1):
            budget = max(0, pages - reserve) * self.block
            num_chunks, resident = 0, 0
            for p in pending:
                num_chunks += 1
                resident += p.cached + p.new
                if resident > budget:  # chunked or left out: the last one of the pass
                    break
            if num_chunks <= reserve:
                return budget
        return max(0, pages - len(pending)) * self.block

    def kick(self, group: int) -> None:
        """If the EP group is idle, plan every member PE's next pass (``plan_forward``, PEs in
        id order) and start them together: the group runs in lockstep, and the planned PEs
        exchange their hidden states every layer (``ExchangePlan``)."""
        members = self.groups[group]
        if any(e in self.in_pass for e in members):
            return
        now = self.now()
        queues: dict[int, tuple[tuple[PendingPrefill, ...], int | None]] = {}
        for e in members:
            rids = self.pe_queue[e]
            if not self.env.options.batching:
                rids = rids[:1]
            if not rids:
                continue
            pending = tuple(
                PendingPrefill(r, self.reqs[r].kv_tokens, len(self.reqs[r].tokens) - self.reqs[r].kv_tokens)
                for r in rids
            )  # fmt: skip
            queues[e] = (pending, self.kv_budget_tokens(pending))
        planned: list[tuple[int, ForwardBatch]] = []
        for e, batch in self.ledger.plan_group(self.policy, queues, now):
            if not batch.chunks:
                raise RuntimeFailure(f"PE {e}: queued requests but plan_forward planned nothing")
            self.in_pass[e] = batch
            self.counters.passes += 1
            self.counters.pass_chunks += len(batch.chunks)
            self.counters.max_pass_tokens = max(
                self.counters.max_pass_tokens, sum(c.cached + c.new for c in batch.chunks)
            )
            planned.append((e, batch))
        if planned and (self.events.wants(ForwardStarted) or self.events.wants(ForwardDone)):
            batches = tuple((e, tuple((c.cached, c.new) for c in b.chunks)) for e, b in planned)
            self.group_pass[group] = (now, batches)
            self.events.emit(ForwardStarted(now, tuple(members), batches))
        exchange = self._exchange_plan(planned)
        for e, batch in planned:
            ex = exchange if exchange is not None and e in exchange.engines else None
            self.launcher.engine_inbox[e].put(
                ForwardMsg(tuple(self._work(c) for c in batch.chunks), self.layerwise, ex)
            )

    def _exchange_plan(self, planned: list[tuple[int, ForwardBatch]]) -> ExchangePlan | None:
        """The all-gather of one group pass among its planned PEs that announced an exchange
        region (a respawned PE joins once its readiness ack arrived); None for fewer than 2."""
        names = [(e, b, self.topo.engine_name(e)) for e, b in planned]
        ready = [(e, b, n) for e, b, n in names if n in self.launcher.engine_regions]
        if len(ready) < 2:
            return None
        self.next_pass_id += 1
        return ExchangePlan(
            self.next_pass_id,
            tuple(e for e, _, _ in ready),
            tuple(self.launcher.engine_regions[n] for _, _, n in ready),
            tuple(self.launcher.procs[n].pid for _, _, n in ready),
            tuple(sum(c.new for c in b.chunks) for _, b, _ in ready),
        )

    def _work(self, c: Any) -> ChunkWork:
        req = self.reqs[c.request_id]
        if c.cached == req.cached:  # first chunk
            req.prefill_start_s = max(self.now(), req.read_done_s)
        req.in_pass = True
        on_pe = req.read_side is ReadSide.PE
        hit_node = self.topo.node_of(req.pe if on_pe else req.de)
        first_on_pe = on_pe and c.cached == req.cached
        return ChunkWork(
            req.request_id, req.tokens[: c.cached + c.new], c.cached, c.new, req.cached, hit_node,
            tuple(req.pe_slots if on_pe else req.de_slots), self.topo.node_of(req.de),
            tuple(req.de_slots), 0 if first_on_pe else c.cached, c.is_last, req.sampling,
        )  # fmt: skip

    def _forward_done(self, msg: ForwardDoneMsg) -> None:
        batch = self.in_pass.pop(msg.engine_id, None)
        if batch is None:  # a pass of an engine declared dead
            return
        self._report_free(msg.engine_id, msg.free_pages)
        self.counters.layer_in_bytes += msg.bytes_in
        self.counters.pd_bytes += msg.bytes_out
        self.counters.pass_new_tokens += sum(c.new for c in batch.chunks)
        self.counters.pass_busy_s += msg.done_s - msg.start_s
        self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
        firsts = dict(msg.first_tokens)
        for rid, lp in msg.first_logprobs:
            if rid in self.reqs:
                self.reqs[rid].logprobs.append(lp)
        for c in batch.chunks:
            req = self.reqs[c.request_id]
            req.in_pass = False
            if req.phase is Phase.ABORTED:
                self._free_slots(req)  # the last writer of an aborted request is done
                continue
            req.kv_tokens = c.cached + c.new
            if not c.is_last:
                self.counters.chunked += 1
                continue
            self.pe_queue[msg.engine_id].remove(req.request_id)
            self._prefill_done(req, firsts[req.request_id], msg.done_s)
        group = self.topo.group_of(msg.engine_id)
        started = self.group_pass.get(group)
        members = self.groups[group]
        if started is not None and not any(e in self.in_pass for e in members):
            del self.group_pass[group]  # the group's pass is over: its last PE reported
            self.events.emit(ForwardDone(self.now(), tuple(members), started[1], started[0]))
        self.kick(group)

    # ------------------------------------------------------------------ results
    def on_message(self, msg: Any) -> None:
        if isinstance(msg, ErrorMsg):
            raise RuntimeFailure(f"{msg.who}: {msg.text}")
        if isinstance(msg, ReadyMsg):  # a respawned engine: its exchange region is new
            if msg.region is not None and msg.who in self.launcher.procs:
                self.launcher.engine_regions[msg.who] = msg.region
            return
        if isinstance(msg, PersistedMsg):
            if not msg.ok:  # dropped (e.g. full disk): not cached, later turns recompute it
                self.counters.persist_failed += 1
            self._persisted(msg.key)
            return
        if isinstance(msg, ForwardDoneMsg):
            self._forward_done(msg)
            return
        if isinstance(msg, TokensMsg):  # one decode step of a DE
            self._note_gpu(msg.engine_id, msg.emulated_s, msg.host_s)
            for rid, lp in msg.logprobs:  # (before the tokens: a callback reads them)
                req = self.reqs.get(rid)
                if req is not None and req.phase is Phase.DECODING and rid in self.token_callbacks:
                    req.logprobs.append(lp)
            for rid, token in msg.tokens:
                req = self.reqs.get(rid)
                if req is not None and req.phase is Phase.DECODING:
                    req.generated += 1
                    self.generated[msg.engine_id] += 1
                    if rid in self.token_callbacks:
                        req.streamed.append(token)
                        self._emit(req, (*req.resumed, req.first_token, *req.streamed), False)
            return
        if isinstance(msg, (LoadedMsg, DecodeDoneMsg)):
            self._report_free(msg.engine_id, msg.free_pages)
        req = self.reqs.get(msg.request_id)
        if req is None or req.phase in (Phase.ABORTED, Phase.DONE):
            if req is not None and isinstance(msg, (ReadDoneMsg, LoadedMsg)):
                self._free_slots(req)  # the last writer of an aborted request is done
            return
        if isinstance(msg, ReadDoneMsg):
            if not req.reading:  # a read re-issued after a storage respawn: done once
                return
            self.counters.read_windows.setdefault(msg.node_id, []).append((msg.start_s, msg.done_s))
            self._read_done(req, msg.num_ok, msg.done_s)
        elif isinstance(msg, LoadedMsg):
            self.launcher.buffers[self.topo.node_of(req.de)].free(req.de_slots)
            req.de_slots = []
            self.ledger.loaded(req, self.now())  # the DE's free pages count it from now on
            req.generated = 1  # token 1 counts on the DE from its admission (SPEC §13.4)
            self.generated[req.de] += 1
        elif isinstance(msg, DecodeDoneMsg):
            self._decode_done(req, msg)

    def _note_gpu(self, engine: int, emulated_s: float, host_s: float) -> None:
        """Count an engine's pass under emulated GPU time (and whether it overran)."""
        if emulated_s > 0.0:
            self.counters.gpu.setdefault(engine, GpuUse()).add(emulated_s, host_s)

    def _prefill_done(self, req: Req, first_token: int, done_s: float) -> None:
        self.ledger.first_token(req, done_s)  # it leaves its PE
        req.first_token = first_token
        self._emit(req, (*req.resumed, first_token), False)
        if req.pe_slots:
            self.launcher.buffers[self.topo.node_of(req.pe)].free(req.pe_slots)
            req.pe_slots = []
        self.launcher.engine_inbox[req.de].put(DecodeMsg(
            req.request_id, req.tokens, first_token, req.output_tokens, tuple(req.de_slots),
            req.cached // self.block, req.sampling, req.namespace,
        ))  # fmt: skip

    def _decode_done(self, req: Req, msg: DecodeDoneMsg) -> None:
        self.counters.h2d_bytes += msg.bytes_in
        self.counters.persisted_blocks += len(msg.persisted_keys)
        self.generated[req.de] -= req.generated
        req.stamp_done(msg.second_token_s, msg.finish_s)
        if msg.persisted_keys and self.events.wants(Persisted):  # the DE handed them to storage
            size = len(msg.persisted_keys) * self.env.layout.full_block_bytes
            self.events.emit(Persisted(msg.finish_s, self.topo.node_of(req.de), size))
        self.ledger.finish(req, msg.finish_s)  # records it (TurnDone)
        pending_keys = {k for k in msg.persisted_keys if k not in self.acked}
        output = (*req.resumed, *msg.output)  # the whole turn's output, as the client sees it
        if req.request_id in self.token_callbacks and pending_keys:
            # a server's client may resend the conversation as soon as it has the answer:
            # report the turn done once its blocks are durable, so that resend hits them
            self.done_after_persist[req.request_id] = (pending_keys, req, output)
        else:
            self._emit(req, output, True)
        agent = self.agents[req.agent_id]
        agent.finish_turn(req.tokens, msg.output)
        nxt = agent.next_turn()
        if nxt is None:
            return
        # the next turn arrives now (tool latency 0) but is submitted once this turn's blocks
        # are durable, so its hits are what SPEC §9 says the previous turn persisted
        pending = {k for k in msg.persisted_keys if k not in self.acked}
        if pending:
            self.unpersisted[agent.agent_id] = (pending, msg.finish_s)
        else:
            self.submit_or_reject(agent.agent_id, *nxt, arrival_s=msg.finish_s)

    def _persisted(self, key: str) -> None:
        """A write of ``key`` was acknowledged (written or dropped): no turn waits for it."""
        self.acked.add(key)
        self._flush_done(key)
        for agent_id in sorted(self.unpersisted):
            pending, arrival_s = self.unpersisted[agent_id]
            pending.discard(key)
            if not pending:
                del self.unpersisted[agent_id]
                nxt = self.agents[agent_id].next_turn()
                assert nxt is not None
                self.submit_or_reject(agent_id, *nxt, arrival_s=arrival_s)

    def _flush_done(self, key: str | None) -> None:
        """Report the turns whose block writes are all acknowledged (``key`` None: all)."""
        for rid in sorted(self.done_after_persist):
            pending, req, output = self.done_after_persist[rid]
            pending.discard(key)
            if not pending or key is None:
                del self.done_after_persist[rid]
                self._emit(req, output, True)

    # ------------------------------------------------------------------ faults
    def _free_slots(self, req: Req) -> None:
        if req.pe_slots:
            self.launcher.buffers[self.topo.node_of(req.pe)].free(req.pe_slots)
        if req.de_slots:
            self.launcher.buffers[self.topo.node_of(req.de)].free(req.de_slots)
        req.pe_slots, req.de_slots = [], []

    def recover(self) -> None:
        """Respawn dead engines; re-queue every unfinished request that depended on one.

        A dead PE matters until its prefill is done, a dead DE until decode is done. Slots
        that a live process may still write (an in-flight read or prefill) are freed when it
        reports back, never earlier."""
        now = self.now()
        if now - self._liveness_checked_s < LIVENESS_CHECK_S:
            return  # ``liveness_timeout_s`` is seconds: a round every 5 ms need not look
        self._liveness_checked_s = now
        for name in self.launcher.dead_workers():
            self._recover_storage(int(name.removeprefix("storage@node")))
        for e in self.launcher.dead_engines():
            self.launcher.respawn(e)
            self.in_pass.pop(e, None)
            for req in sorted(self.reqs.values(), key=lambda r: r.request_id):
                if req.phase in (Phase.DONE, Phase.ABORTED, Phase.QUEUED):
                    continue
                pe_lost = req.pe == e and req.phase in (Phase.READING, Phase.PREFILLING)
                if not (pe_lost or req.de == e):
                    continue
                in_flight = req.reading or (req.in_pass and req.pe != e)
                self._abort(req, free_now=not in_flight)
                self.counters.requeued += 1
                self._resubmit(req)
            self._report_free(e, self._pool_pages(e))  # a fresh engine: its whole pool
            for group in sorted(self.groups):
                self.kick(group)

    def _resubmit(self, req: Req) -> None:
        """Submit an aborted request again, exactly once from its client's view: a server's
        turn continues after the tokens already delivered (they end the new prompt; the
        counter-based sampler draws the next ones as the lost engine would have), never
        sending one twice; a turn whose delivered tokens already end it is finished here."""
        cb = self.token_callbacks.pop(req.request_id, None)
        delivered = (req.first_token, *req.streamed) if cb and req.first_token >= 0 else ()
        resumed = (*req.resumed, *delivered)
        total = len(req.resumed) + req.output_tokens  # the turn's output budget
        stops = req.sampling.stop_token_ids if req.sampling else ()
        agent = self.agents[req.agent_id]
        if resumed and (len(resumed) >= total or resumed[-1] in stops):
            agent.finish_turn(req.tokens[: len(req.tokens) - len(req.resumed)], resumed)
            if cb is not None:
                cb(req.request_id, resumed, True)
            return
        append = (*req.tokens[len(agent.context) :], *delivered)
        sampling = req.sampling
        if sampling is not None and resumed:
            sampling = replace(sampling, first_index=len(resumed), history=resumed)
        again = self.submit_turn(req.agent_id, append, total - len(resumed), sampling=sampling)
        again.resumed = resumed
        again.logprobs = req.logprobs[: len(resumed)]
        if cb is not None:
            self.token_callbacks[again.request_id] = cb

    def _recover_storage(self, node: int) -> None:
        """Respawn a dead storage worker; re-issue its reads and its queued writes. Writes it
        had already taken are lost: their keys are treated as not cached (the turns waiting on
        them go ahead and recompute what is missing)."""
        pending = self.launcher.respawn_storage(node)
        inbox = self.env.storage_inboxes[node]
        for msg in pending:
            if isinstance(msg, PersistMsg):
                inbox.put(msg)
        for req in sorted(self.reqs.values(), key=lambda r: r.request_id):
            if req.reading and req.read_node == node:
                self.counters.requeued += 1
                self._start_read(req, retry=True)  # the same slots: the retry overwrites them
        self._flush_done(None)  # lost writes will never be acknowledged
        for agent_id in sorted(self.unpersisted):
            _, arrival_s = self.unpersisted.pop(agent_id)
            nxt = self.agents[agent_id].next_turn()
            if nxt is not None:
                self.submit_or_reject(agent_id, *nxt, arrival_s=arrival_s)

    def _abort(self, req: Req, free_now: bool) -> None:
        self.ledger.abort(req, self.now())  # it leaves every counter
        if req.generated:
            self.generated[req.de] -= req.generated
            req.generated = 0
        if req.request_id in self.pe_queue[req.pe]:
            self.pe_queue[req.pe].remove(req.request_id)
        if free_now:
            self._free_slots(req)

    # ------------------------------------------------------------------ main loop
    def record_ledger(self, path: str) -> None:
        """Write every ledger input of this run to ``path``, one JSON record a line (for
        ``dualpath.ledger.replay``); call before the first turn is submitted."""
        out = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed when the run ends)
        self._journal_file = out

        def write(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")

        self.ledger.start_journal(write)

    def run(self, until: threading.Event | None = None) -> RunResult:
        """Drive every turn to the end; with ``until`` (a server), keep serving submitted
        turns until it is set, then abort what is still running."""
        try:
            return self._run(until)
        finally:
            if self._journal_file is not None:
                self._journal_file.close()

    def _run(self, until: threading.Event | None) -> RunResult:
        start = self.now()
        last_progress = start
        # a server's API ends each request at request_timeout_s and cancels it: the run is
        # declared stuck (fatal) only if that did not unstick it
        timeout_s = self.env.options.request_timeout_s * (1 if until is None else 2)
        while True:
            self._drain_external()
            busy = (
                any(not a.finished for a in self.agents.values())
                or any(r.phase not in (Phase.DONE, Phase.ABORTED) for r in self.reqs.values())
                or bool(self.done_after_persist)  # turns reported done once durable
            )
            if until is not None and until.is_set():
                for rid in sorted(self.reqs):
                    self._cancel(rid)
                break
            if not busy and until is None:
                break
            if not busy:
                last_progress = self.now()  # idle is not stuck
            self.recover()
            self.schedule()
            self.try_alloc()
            try:
                msg = self.launcher.results.get(timeout=IDLE_WAIT_S)
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
                    self.on_message(self.launcher.results.get_nowait())
                except queue.Empty:
                    break
        return RunResult.build(self, start, self.now())
