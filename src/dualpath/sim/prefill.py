"""PE groups: lockstep forward passes with layerwise KV loads and sends (design §4, §7.2, §8).

A group (all PEs of an EP group, or one PE without EP) runs one forward pass at a time. Each
GPU's batch comes from ``policy.plan_forward``; the slowest GPU's attention sets the pace
(bubbles are real), expert/linear time follows the group's total tokens, and the MoE
dispatch/combine is one high-priority flow over the group's CNICs. KV loads and sends are
fluid flows; their layer pipelining is aggregated exactly (``passes.py``) or, with
``per_layer``, simulated layer by layer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from dualpath.config import HardwareConfig, ModelConfig
from dualpath.ledger import Core, EventBus, ForwardDone, ForwardStarted
from dualpath.models import cost
from dualpath.policy.base import PendingPrefill
from dualpath.policy.commands import Chunk
from dualpath.sim.admission import HbmAdmission
from dualpath.sim.events import EventLoop, Priority
from dualpath.sim.fabric import Fabric
from dualpath.sim.node_io import NodeIO
from dualpath.sim.passes import AggregatePass, PassPlan, PerLayerPass
from dualpath.sim.request import Req
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath, ReuseSource


class PendingQueue(Sequence[PendingPrefill]):
    """A PE's local queue as the policy's ``PendingPrefill`` sequence, built item by item
    when read: packing stops at the first request that does not fit whole, so a pass over a
    long queue reads only its head (not O(queue) objects per pass)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: deque[Req]) -> None:
        self._queue = queue

    def __len__(self) -> int:
        return len(self._queue)

    @overload
    def __getitem__(self, i: int) -> PendingPrefill: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PendingPrefill]: ...

    def __getitem__(self, i: int | slice) -> PendingPrefill | Sequence[PendingPrefill]:
        if isinstance(i, slice):
            return [_pending(r) for r in list(self._queue)[i]]
        return _pending(self._queue[i])

    def __iter__(self) -> Iterator[PendingPrefill]:
        return map(_pending, self._queue)


def _pending(r: Req) -> PendingPrefill:
    return PendingPrefill(r.request_id, r.kv_tokens, r.prompt_tokens - r.kv_tokens)


class PrefillGroup:
    def __init__(
        self,
        members: tuple[int, ...],
        *,
        loop: EventLoop,
        core: Core[Any, Req],
        fabric: Fabric,
        transfers: Transfers,
        node_ios: list[NodeIO],
        reqs: dict[int, Req],
        model: ModelConfig,
        hw: HardwareConfig,
        layerwise: bool,
        per_layer: bool,
        collectives: bool,
        on_prefill_done: Callable[[Req], None],
        events: EventBus | None = None,
        read_ahead_requests: int = 0,
        read_ahead_bytes: float = 0.0,
    ) -> None:
        self.members = members
        self.loop = loop
        self.core = core
        self.fabric = fabric
        self.transfers = transfers
        self.node_ios = node_ios
        self.reqs = reqs
        self.model = model
        self.hw = hw
        self.layerwise = layerwise
        self.per_layer = per_layer and layerwise
        self.collectives = collectives and len(members) > 1
        self.on_prefill_done = on_prefill_done
        self.events = events if events is not None else EventBus()
        self.kv_per_token = cost.kv_bytes_per_token(model)
        self._attention_time = cost.attention_time_fn(model, hw)
        self._fixed_s = cost.prefill_fixed_s(model, hw, len(members))
        self.max_batch_tokens = 0  # largest (cached + new) tokens of one PE's batch in a pass
        # Without layerwise prefill the batch's whole KV must fit in one GPU's HBM.
        self.kv_budget_tokens = (
            None if layerwise else cost.kv_capacity_tokens(model, hw, len(members))
        )
        self.queues: dict[int, deque[Req]] = {pe: deque() for pe in members}
        # The classic engine reads a request's hit KV only once its HBM is reserved.
        self.admission: dict[int, HbmAdmission] = {}
        if self.kv_budget_tokens is not None:
            budget = self.kv_budget_tokens
            for pe in members:
                node = node_ios[fabric.topology.node_of(pe)]
                self.admission[pe] = HbmAdmission(
                    pe,
                    budget,
                    read_ahead_requests,
                    read_ahead_bytes,
                    self.add_ready,
                    node.note_hbm_waiting,
                )
        self.busy = False
        self.kicked = False
        self.num_passes = 0
        self.busy_s: dict[int, float] = dict.fromkeys(members, 0.0)  # GPU compute time
        self.pass_s = 0.0  # wall time of all passes (incl. transfer stalls)
        self._batches: list[tuple[int, tuple[Chunk, ...]]] = []
        self._pass_start = 0.0
        self._aggregate: AggregatePass | None = None
        self._reported: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None = None
        self.collective_s = 0.0  # how long the collectives took (aggregate passes)
        self.collective_ideal_s = 0.0  # ... at the full CNIC rate

    # ------------------------------------------------------------------ intake
    def offer(self, req: Req, read_bytes: float, start: Callable[[], None] | None) -> None:
        """``req`` was assigned to one of this group's PEs; ``start`` starts its storage
        reads (None: nothing to read). Layerwise: the reads start now (the PE buffer bounds
        them); classic: once the PE's HBM admission lets them."""
        admission = self.admission.get(req.pe)
        if admission is not None:
            admission.offer(req, read_bytes, start)
        elif start is not None:
            start()
        else:
            self.add_ready(req)

    def read_done(self, req: Req) -> None:
        """All of ``req``'s storage reads landed."""
        admission = self.admission.get(req.pe)
        if admission is not None:
            admission.read_done(req)
        else:
            self.add_ready(req)

    def add_ready(self, req: Req) -> None:
        """``req``'s hit KV is in a buffer: it joins its PE's local FIFO queue."""
        self.queues[req.pe].append(req)
        self.kick()

    def kick(self) -> None:
        # Start at the current instant, after every completion of the instant, so that
        # reads finishing together join one batch.
        if not self.busy and not self.kicked:
            self.kicked = True
            self.loop.at(self.loop.now, self._start_pass, Priority.START, "pe_pass")

    # ------------------------------------------------------------------ planning
    def _plan_batches(self) -> list[tuple[int, tuple[Chunk, ...]]]:
        queues = {
            pe: (PendingQueue(self.queues[pe]), self.kv_budget_tokens)
            for pe in self.members
            if self.queues[pe]
        }
        planned = self.core.plan_group(queues, self.loop.now)
        return [(pe, batch.chunks) for pe, batch in planned if batch.chunks]

    def _make_plan(self, batches: list[tuple[int, tuple[Chunk, ...]]]) -> PassPlan:
        model, hw, fabric, kvpt = self.model, self.hw, self.fabric, self.kv_per_token
        size = len(self.members)
        total_new = 0
        attention: dict[int, float] = {}
        loads: dict[tuple[tuple[int, ...], str], float] = {}  # (path, kind) → bytes
        sends: dict[tuple[int, ...], list] = {}
        for pe, chunks in batches:
            attention[pe] = self._attention_time([(c.cached, c.new) for c in chunks])
            for c in chunks:
                total_new += c.new
                req = self.reqs[c.request_id]
                first = c.cached == req.hit_tokens
                from_pe = req.pe_read_tokens
                sent_hits = 0 if req.de_prefetch_tokens else from_pe  # the DE lacks them
                if req.reuse_tokens:  # hits found without storage (docs/peers.md)
                    reused, sent = self._reuse_loads(req, pe, loads)
                    sent_hits += sent
                else:
                    reused = 0
                # DE-side hits and earlier chunks (in the DE buffer)
                from_de = c.cached - from_pe - reused
                if from_pe:
                    path = fabric.pe_load_path(pe)
                    _add(loads, path, KVPath.PE_BUFFER_TO_PE_HBM, from_pe * kvpt)
                if from_de:
                    path = fabric.de_load_path(req.de, pe)
                    _add(loads, path, KVPath.DE_BUFFER_TO_PE_HBM, from_de * kvpt)
                # Sent to the DE buffer: this chunk's new KV, plus the hits it lacks once.
                send_bytes = (c.new + (sent_hits if first else 0)) * kvpt
                path = fabric.send_path(pe, req.de)
                sends.setdefault(path, [KVPath.PE_HBM_TO_DE_BUFFER.value, 0.0])[1] += send_bytes
                req.de_buffer_bytes += send_bytes
                self.node_ios[fabric.topology.node_of(req.de)].hold(send_bytes)
        linear = cost.prefill_linear_time_s(model, hw, total_new / size, size)
        for pe in self.members:
            self.busy_s[pe] += attention.get(pe, 0.0) + linear
        # fixed cost of a pass (overheads, EP latency) is pass time, not busy compute
        plan = PassPlan(max(attention.values()) + linear + self._fixed_s)
        plan.loads = [(k, p, b) for (p, k), b in sorted(loads.items())]
        plan.sends = [(k, p, b) for p, (k, b) in sorted(sends.items())]
        if self.collectives:
            per_gpu = cost.moe_collective_bytes(
                model, round(total_new / size), size, hw.gpus_per_node
            )
            if per_gpu > 0:
                plan.collective = ("collectives", fabric.collective_path(self.members), per_gpu)
        return plan

    def _reuse_loads(
        self, req: Req, pe: int, loads: dict[tuple[tuple[int, ...], str], float]
    ) -> tuple[int, int]:
        """Add the load of ``req``'s hits found without storage to ``loads``: from the PE's
        own HBM (nothing to move), its node's DRAM tier (DRAM → HBM, as a PE-buffer load),
        or another node (a DE's HBM or node DRAM, a peer's tier: over that node's CNIC on
        the PE's rail). Returns (tokens reused, tokens of them the DE lacks)."""
        tokens, source = req.reuse_tokens, req.reuse_source
        if source is ReuseSource.PE_HBM:
            return tokens, tokens
        kv_bytes = tokens * self.kv_per_token
        if source is ReuseSource.PE_DRAM:
            path = self.fabric.pe_load_path(pe)
            _add(loads, path, KVPath.PE_DRAM_TO_PE_HBM, kv_bytes)
            return tokens, tokens
        # another node's: through an engine there, on the PE's rail (``Fabric.de_cnic``);
        # DE_HBM, DE_DRAM: the request's own DE holds them
        elsewhere = source in (ReuseSource.PEER_DRAM, ReuseSource.PEER_HBM)
        holder = req.reuse_node * self.fabric.topology.gpus_per_node if elsewhere else req.de
        path = self.fabric.de_load_path(holder, pe)
        _add(loads, path, KVPath.PEER_TO_PE_HBM, kv_bytes)
        return tokens, tokens if elsewhere else 0

    # ------------------------------------------------------------------ running a pass
    def _start_pass(self) -> None:
        self.kicked = False
        if self.busy:
            return
        batches = self._plan_batches()
        if not batches:
            if any(self.queues[pe] for pe in self.members):
                raise RuntimeError(
                    f"PE group {self.members[0]}: queued requests but plan_forward returned an "
                    "empty batch (a request larger than the HBM KV budget?)"
                )
            return
        self.busy = True
        now = self.loop.now
        pass_started = self.core.pass_started
        for _, chunks in batches:
            for c in chunks:
                req = self.reqs[c.request_id]
                if req.prefill_start_s < 0:
                    req.prefill_start_s = now
                pass_started(req, now)
        self._batches = batches
        self._pass_start = now
        for _, chunks in batches:  # KV in one GPU's HBM during the pass (cached + new)
            tokens = sum(c.cached + c.new for c in chunks)
            if tokens > self.max_batch_tokens:
                self.max_batch_tokens = tokens
        if self.events.wants(ForwardStarted) or self.events.wants(ForwardDone):
            self._reported = _chunk_sizes(batches)
            self.events.emit(ForwardStarted(now, self.members, self._reported))
        plan = self._make_plan(batches)
        layers = self.model.num_layers
        if self.per_layer:
            PerLayerPass(self.loop, self.transfers, layers, plan, self._end_pass).start()
        else:
            agg = AggregatePass(
                self.loop,
                self.transfers,
                layers,
                plan,
                self.layerwise,
                self._end_pass,
                None if self.layerwise else self._release_pe_buffers,
            )
            self._aggregate = agg
            agg.start()
        if plan.collective:
            self.collective_ideal_s += plan.collective[2] / self.hw.cnic_bytes_per_s

    def _release_pe_buffers(self) -> None:
        """Classic pass: its loads landed, the batch's hit KV is in HBM (reserved at
        admission), so the PE buffer no longer holds it (layerwise passes free it at the end
        of the request's prefill: its Layer Blocks move during the whole pass)."""
        for pe, chunks in self._batches:
            node = self.node_ios[self.fabric.topology.node_of(pe)]
            for c in chunks:
                req = self.reqs[c.request_id]
                if req.pe_buffer_bytes:
                    node.release(req.pe_buffer_bytes)
                    req.pe_buffer_bytes = 0.0

    def _end_pass(self) -> None:
        batches = self._batches
        self._batches = []
        if self._reported is not None:
            self.events.emit(
                ForwardDone(self.loop.now, self.members, self._reported, self._pass_start)
            )
            self._reported = None
        self.num_passes += 1
        self.pass_s += self.loop.now - self._pass_start
        if self._aggregate is not None:
            self.collective_s += self._aggregate.collective_s
            self._aggregate = None
        done: list[Req] = []
        now, chunk_done = self.loop.now, self.core.chunk_done
        for pe, chunks in batches:
            queue = self.queues[pe]
            for c in chunks:
                req = self.reqs[c.request_id]
                if c.is_last:  # token 1: ``on_prefill_done`` reports it
                    queue.remove(req)
                    done.append(req)
                else:
                    chunk_done(req, c.new, now)
        self.busy = False
        for req in done:
            self.on_prefill_done(req)
        if self.admission:  # the classic pass ends after its send: free the batch's HBM
            for req in done:
                self.admission[req.pe].release(req)
        if any(self.queues[pe] for pe in self.members):
            self.kick()


def _add(
    loads: dict[tuple[tuple[int, ...], str], float],
    path: tuple[int, ...],
    kind: KVPath,
    num_bytes: float,
) -> None:
    """Count ``num_bytes`` of a pass's loads of ``kind`` over ``path`` (one flow each)."""
    key = (path, kind.value)
    loads[key] = loads.get(key, 0.0) + num_bytes


def _chunk_sizes(
    batches: list[tuple[int, tuple[Chunk, ...]]],
) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """``(pe, ((cached, new), ...))`` per PE of a pass, as the forward events report it."""
    return tuple((pe, tuple((c.cached, c.new) for c in chunks)) for pe, chunks in batches)
