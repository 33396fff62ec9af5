"""PE forward passes: each PE's local queue, the pass in flight per PE, an EP group's passes
planned together (``Ledger.plan_group``, the simulator's planner) and started in lockstep
with their hidden-state exchange (``ExchangePlan``). Owns the queues and passes; hands the
turns whose prefill is done back to the caller."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from dualpath.kv.transport.base import RegionHandle
from dualpath.ledger import Core, EventBus, ForwardDone, ForwardStarted, Phase, Topology
from dualpath.ledger.counters import RunCounters
from dualpath.metrics.hops import hop
from dualpath.policy import PendingPrefill
from dualpath.policy.commands import Chunk, ForwardBatch
from dualpath.runtime.launcher import RuntimeFailure
from dualpath.runtime.messages import ChunkWork, ExchangePlan, ForwardDoneMsg, ForwardMsg
from dualpath.runtime.requests import Req
from dualpath.runtime.scheduler.slots import Slots
from dualpath.types import KVPath, ReadSide


class EnginePorts(Protocol):
    """What a pass needs of the launcher: an engine's inbox and its exchange region."""

    def send(self, engine: int, msg: Any) -> None: ...
    def exchange_peer(self, name: str) -> tuple[RegionHandle, int] | None: ...


def kv_budget_tokens(
    pending: tuple[PendingPrefill, ...], pe_pages: int, num_layers: int, block: int, layerwise: bool
) -> int:
    """Cached + new tokens one pass may hold: Basic holds every layer of the batch, layerwise
    two layers (one computing, the next loading). A page is a Layer Block, so each chunk of
    the pass may waste up to one page per layer: the budget keeps back one page per chunk the
    pass can hold (the queue's FIFO prefix that fits, plus one chunked request), the fewest
    that is still safe."""
    window = min(2, num_layers) if layerwise else num_layers
    pages = pe_pages // window
    for reserve in range(len(pending) + 1):
        budget = max(0, pages - reserve) * block
        num_chunks, resident = 0, 0
        for p in pending:
            num_chunks += 1
            resident += p.cached + p.new
            if resident > budget:  # chunked or left out: the last one of the pass
                break
        if num_chunks <= reserve:
            return budget
    return max(0, pages - len(pending)) * block


class Passes:
    def __init__(
        self,
        topo: Topology,
        core: Core[Any, Req],
        ports: EnginePorts,
        slots: Slots,
        reqs: Mapping[int, Req],
        counters: RunCounters,
        events: EventBus,
        budget: Callable[[tuple[PendingPrefill, ...]], int],
        layerwise: bool,
        batching: bool,
        now: Callable[[], float],
    ) -> None:
        self.topo, self.core, self.ports = topo, core, ports
        self.slots, self.reqs, self.counters, self.events = slots, reqs, counters, events
        self.budget, self.layerwise, self.batching, self.now = budget, layerwise, batching, now
        self.pe_queue: dict[int, list[int]] = {e: [] for e in topo.pe_ids}
        self.in_pass: dict[int, ForwardBatch] = {}  # PE → its pass in flight
        self.groups: dict[int, list[int]] = {}
        for e in topo.pe_ids:
            self.groups.setdefault(topo.group_of(e), []).append(e)
        # group → (start, batches) of its pass in flight, for ForwardStarted / ForwardDone
        self.group_pass: dict[int, tuple[float, Any]] = {}
        self.next_pass_id = 0  # ids of group passes (the exchange's sequence numbers)
        self._deferred: set[int] | None = None  # groups to kick when the round ends

    # ------------------------------------------------------------------ queues
    def enqueue(self, req: Req) -> None:
        """``req``'s hit KV is in a buffer (READY): it joins its PE's local queue."""
        self.pe_queue[req.pe].append(req.request_id)
        group = self.topo.group_of(req.pe)
        if self._deferred is not None:  # inside a round: kicked when it ends
            self._deferred.add(group)
        else:
            self.kick(group)

    def begin_round(self) -> None:
        """Turns queued from now on are planned together when ``end_round`` comes, so turns
        ready together are batched together (not the first alone)."""
        self._deferred = set()

    def end_round(self) -> None:
        groups, self._deferred = self._deferred or set(), None
        for group in sorted(groups):
            self.kick(group)

    def drop(self, req: Req) -> None:
        """``req`` was aborted: it leaves its PE's queue."""
        if req.request_id in self.pe_queue[req.pe]:
            self.pe_queue[req.pe].remove(req.request_id)

    def engine_died(self, engine: int) -> None:
        self.in_pass.pop(engine, None)

    def kick_all(self) -> None:
        for group in sorted(self.groups):
            self.kick(group)

    # ------------------------------------------------------------------ a group's pass
    def kick(self, group: int) -> None:
        """If the EP group is idle, plan every member PE's next pass (PEs in id order) and
        start them together: the group runs in lockstep, and the planned PEs exchange their
        hidden states every layer (``ExchangePlan``)."""
        members = self.groups[group]
        if any(e in self.in_pass for e in members):
            return
        now = self.now()
        reqs = self.reqs
        queues: dict[int, tuple[tuple[PendingPrefill, ...], int | None]] = {}
        for e in members:
            rids = self.pe_queue[e] if self.batching else self.pe_queue[e][:1]
            if not rids:
                continue
            pending = tuple(
                PendingPrefill(r, reqs[r].kv_tokens, len(reqs[r].tokens) - reqs[r].kv_tokens)
                for r in rids
            )
            queues[e] = (pending, self.budget(pending))
        planned: list[tuple[int, ForwardBatch]] = []
        for e, batch in self.core.plan_group(queues, now):
            if not batch.chunks:
                raise RuntimeFailure(f"PE {e}: queued requests but plan_forward planned nothing")
            self.in_pass[e] = batch
            self.counters.pass_started((c.cached, c.new) for c in batch.chunks)
            planned.append((e, batch))
        if planned and (self.events.wants(ForwardStarted) or self.events.wants(ForwardDone)):
            batches = tuple((e, tuple((c.cached, c.new) for c in b.chunks)) for e, b in planned)
            self.group_pass[group] = (now, batches)
            self.events.emit(ForwardStarted(now, tuple(members), batches))
        exchange = self._exchange_plan(planned)
        for e, batch in planned:
            ex = exchange if exchange is not None and e in exchange.engines else None
            work = tuple(self._work(c) for c in batch.chunks)
            for w in work:
                hop("sched.pass_sent", w.request_id)
            self.ports.send(e, ForwardMsg(work, self.layerwise, ex))

    def _exchange_plan(self, planned: list[tuple[int, ForwardBatch]]) -> ExchangePlan | None:
        """The all-gather of one group pass among its planned PEs that announced an exchange
        region (a respawned PE joins once its readiness ack arrived); None for fewer than 2."""
        ready = []
        for e, b in planned:
            peer = self.ports.exchange_peer(self.topo.engine_name(e))
            if peer is not None:
                ready.append((e, b, *peer))
        if len(ready) < 2:
            return None
        self.next_pass_id += 1
        return ExchangePlan(
            self.next_pass_id,
            tuple(e for e, _, _, _ in ready),
            tuple(region for _, _, region, _ in ready),
            tuple(pid for _, _, _, pid in ready),
            tuple(sum(c.new for c in b.chunks) for _, b, _, _ in ready),
        )

    def _work(self, c: Chunk) -> ChunkWork:
        req = self.reqs[c.request_id]
        now = self.now()
        if c.cached == req.cached:  # first chunk
            req.prefill_start_s = max(now, req.read_done_s)
        self.core.pass_started(req, now)
        on_pe = req.read_side is ReadSide.PE
        hit_node = self.topo.node_of(req.pe if on_pe else req.de)
        first_on_pe = on_pe and c.cached == req.cached
        return ChunkWork(
            req.request_id,
            req.tokens[: c.cached + c.new],
            c.cached,
            c.new,
            req.cached,
            hit_node,
            tuple(req.pe_slots if on_pe else req.de_slots),
            self.topo.node_of(req.de),
            tuple(req.de_slots),
            0 if first_on_pe else c.cached,
            c.is_last,
            req.sampling,
        )

    def forward_done(self, msg: ForwardDoneMsg) -> list[tuple[Req, int]] | None:
        """A PE's pass came back: the turns whose last chunk it was, with their first token
        (None: the pass of an engine declared dead). An aborted turn's slots are freed here:
        its last writer is done."""
        batch = self.in_pass.pop(msg.engine_id, None)
        if batch is None:
            return None
        self.counters.moved(KVPath.BUFFER_TO_PE_HBM, msg.bytes_in)
        self.counters.moved(KVPath.PE_HBM_TO_DE_BUFFER, msg.bytes_out)
        self.counters.pass_done(sum(c.new for c in batch.chunks), msg.start_s, msg.done_s)
        firsts = dict(msg.first_tokens)
        for rid, lp in msg.first_logprobs:
            if rid in self.reqs:
                self.reqs[rid].logprobs.append(lp)
        done: list[tuple[Req, int]] = []
        for c in batch.chunks:
            req = self.reqs[c.request_id]
            if req.phase is Phase.ABORTED:
                self.slots.free(req)
                continue
            if not c.is_last:
                self.core.chunk_done(req, c.new, msg.done_s)
                self.counters.chunked += 1
                continue
            self.pe_queue[msg.engine_id].remove(req.request_id)
            done.append((req, firsts[req.request_id]))
        return done

    def pass_over(self, engine: int) -> None:
        """After a PE's pass was handled: the group's ``ForwardDone`` once its last PE
        reported back, then the group's next pass."""
        group = self.topo.group_of(engine)
        started = self.group_pass.get(group)
        members = self.groups[group]
        if started is not None and not any(e in self.in_pass for e in members):
            del self.group_pass[group]
            self.events.emit(ForwardDone(self.now(), tuple(members), started[1], started[0]))
        self.kick(group)
