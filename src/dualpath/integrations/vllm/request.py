"""One request in the DualPath router over vLLM, from its arrival to its one exit.

The third shell around the policy core (after the simulator and our runtime) reports to the
shared ``ledger.Core`` what happens to each turn, as the other two do (submit, pull, read,
pass, first token, finish or abort), and carries out what ``PolicyCore`` decided, nothing
more. A ``Request``'s methods run in its lifecycle's order (design §4):

1. ``place``: tokens (the prefill instance's ``/tokenize``, so they are exactly vLLM's) → the
   store's hit prefix (Full Blocks, per-tenant namespace; blocks of the prefix still queued
   for a write at a node's side-car are waited for first, as the runtime's ``Durability``
   does: the turn before wrote them behind its answer) → a turn submitted; the policy picks
   PE, DE and the read side from the view the runtime's reads (seq_e, tok_e, read_q per SNIC,
   free HBM), but a DE's free HBM is its ``hbm_tokens`` less what its turns reserve until they
   finish: vLLM's own free KV is not read, so the shell never reports ``loaded``. Then slots
   in the DE buffer for the whole prompt, and the hit blocks read from storage into the PE
   buffer (PE read path) or straight into the first of those DE slots (DE read path), by that
   node's side-car, through its SNIC;
2. ``prefill_params`` / ``prefilling``: the prefill instance runs with ``max_tokens`` 1: it
   loads the hits layer by layer (from its own node's buffer, or from the DE node's over the
   compute network), and saves each layer's KV into the DE slots (all blocks on the PE path,
   only the new ones on the DE path). While it runs, its instance *pins* the slots it loads
   from and saves into (``SlotBuffer.pin``): a request given up meanwhile gives them back, and
   they are free once the instance is done with them, never while a step still writes them;
3. ``hand_over`` / ``persist_prompt`` / ``prefilled``: across nodes, the prefill's KV goes to
   the DE buffer over the compute network, and the prompt's new blocks are persisted by the
   node the policy names;
4. ``decode_params`` / ``decoding`` / ``generated``: the decode instance loads the whole
   prompt from its buffer (claiming its slots), persists the blocks the store lacks, and
   streams the answer (vLLM recomputes the last prompt token and samples from it, as in
   vLLM's own disaggregated flow), persisting each block its generation fills;
5. ``close(outcome)``: the one exit, however the request ends. It is the only place that
   tells the core a turn finished or was aborted, and every slot the request still holds goes
   back through its ``Lease``.

Across nodes (``NodeSpec.host``: machines, or the network namespaces of ``dualpath cluster
up``) no process touches another node's memory: slots are allocated through each node's
side-car, the prefill loads and saves only its own node's buffer (the request also holds PE
slots for its whole prompt there), and the side-cars move the KV over the compute network
(Mooncake Transfer Engine): on the DE read path the hit blocks DE buffer → PE node before the
prefill (``push``); the new blocks PE node → DE buffer layer by layer while the prefill
computes them (``push_layer``, from the prefill's workers: the layerwise hand-over,
``cnic.py``), and on the PE read path the hits too, meanwhile. ``DUALPATH_HANDOVER=after``:
every block after the prefill instead.

A failed step ends the request with a clean error (nothing half-written is ever a hit: blocks
become hits only once durable); the turn leaves every counter it was in.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from collections.abc import Sequence
from typing import Any

from dualpath.integrations.vllm.flow import FlowError, TurnFlow
from dualpath.integrations.vllm.lease import Lease
from dualpath.integrations.vllm.params import (
    BlockForward,
    BlockLoad,
    BlockPersist,
    BlockSave,
    TransferParams,
)
from dualpath.kv.store import block_keys
from dualpath.ledger.core import Read
from dualpath.ledger.turn import Turn, usable_hit_tokens
from dualpath.policy import Assign
from dualpath.types import KVPath, ReadSide


class Outcome(enum.Enum):
    """How a request ended: its answer went out, or it failed or its client left."""

    ANSWERED = "answered"
    ABORTED = "aborted"


class Request:
    """One request in the router: the route and headers the instances get, its deadline
    (loop time), its turn and the slots it holds, and why it must end now (``ended``: '' while
    nothing it needs is down)."""

    def __init__(
        self,
        flow: TurnFlow,
        rid: int,
        deadline: float,
        path: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.flow = flow
        self.rid = rid
        self.deadline = deadline
        self.path = path
        self.headers = dict(headers or {})
        self.nodes: frozenset[int] | None = None  # None: not placed yet (may touch any node)
        self.ended = ""
        self.timer: asyncio.Timeout | None = None
        self.upstream: Any = None  # the decode's streamed answer (the router closes it)
        self.closed = False
        # the turn, once submitted, and what the policy and the store made of it
        self.turn: Turn | None = None
        self.tokens: list[int] = []
        self.keys: list[str] = []  # of the prompt's Full Blocks
        self.assign: Assign | None = None
        self.hit_blocks = 0  # leading blocks loaded from a buffer (read from storage)
        self.stored_blocks = 0  # leading blocks the store holds (the decode persists the rest)
        self.lease = Lease(rid + 1, flow.release_slots)
        self.de_slots: list[int] = []
        self.pe_slots: list[int] = []
        self.prompt_written = False  # its PE node persists the new prompt blocks (not the DE)
        self.num_generated = 0  # tokens its decode reported so far (the core counts per DE)
        # side-car reads and pushes that may still write into its slots after the router gave
        # up on it: the lease goes back once they are over
        self._writes: set[asyncio.Future[Any]] = set()
        # across nodes: the layerwise hand-over its prefill feeds, until the router closed it
        # (``hand_over``; given up on: ``close``), and the PE read path's hits on their way
        self._forward_open = False
        self._hits: asyncio.Future[Any] | None = None

    def uses(self, nodes: Sequence[int]) -> bool:
        return self.nodes is None or any(n in self.nodes for n in nodes)

    @property
    def placed(self) -> Assign:
        assert self.assign is not None, "the request is not placed yet"
        return self.assign

    def _node(self, engine: int) -> int:
        return self.flow.topology.node_of(engine)

    # ------------------------------------------------------------ 1. place and read
    async def place(self, tokens: list[int], max_tokens: int, tenant: str) -> None:
        flow = self.flow
        bs = flow.dep.block_tokens
        flow.check_fits(len(tokens))
        self.tokens = tokens
        self.keys = keys = block_keys(tokens, bs, flow.dep.namespace(tenant))
        stored = await flow.lookup(keys) // bs
        usable = (len(tokens) - 1) // bs  # usable_hit_tokens' cap
        if stored < usable and await flow.settle(keys[stored:usable]):
            stored = await flow.lookup(keys) // bs
        hit_tokens = usable_hit_tokens(stored * bs, len(tokens), bs)
        self.turn = Turn(self.rid, 0, 0, len(tokens), hit_tokens, max(1, max_tokens), flow.now())
        assign, reads = await flow.submit(self.turn)
        self.assign, self.hit_blocks, self.stored_blocks = assign, hit_tokens // bs, stored
        de_node, pe_node = self._node(assign.de), self._node(assign.pe)
        self.nodes = frozenset((de_node, pe_node))
        need = -(-len(tokens) // bs)
        # across nodes the prefill's KV goes to its own node's buffer first: both nodes'
        # slots asked for at once (two side-cars, one round trip's time)
        self.de_slots, self.pe_slots = await flow.alloc_both(
            de_node, pe_node if flow.networked else None, need, self.lease
        )
        await self._read(keys[: self.hit_blocks], reads)

    async def _read(self, keys: list[str], reads: list[Read]) -> None:
        """The storage read the core gave the turn (``Core.pull``: node, tokens): its blocks
        into the PE buffer (PE read path) or the first of its DE slots (DE read path)."""
        flow, turn, a = self.flow, self.turn, self.placed
        assert turn is not None
        if not reads:
            return
        if len(reads) > 1:  # serve_vllm refuses split_reads at start
            raise FlowError(500, "split reads are not supported by the vLLM engine")
        ((node, tokens),) = reads
        keys = keys[: tokens // flow.dep.block_tokens]
        side = a.read_side
        if side is ReadSide.PE:
            if not flow.networked:
                self.pe_slots = await flow.alloc(node, len(keys), self.lease)
            slots = self.pe_slots[: len(keys)]
        else:
            slots = self.de_slots[: len(keys)]
        op = {"op": "read", "keys": keys, "slots": slots}
        with flow.core_read(turn, node, len(keys)), flow.stats.time_stage("storage_read"):
            answer = await self._side_car(node, op, f"storage read on node {node} failed")
        got = int(answer["num_ok"])
        flow.read_done(side, got)
        if got < self.hit_blocks:  # a block went missing or was corrupt: recompute from there
            self.hit_blocks = got
            self.stored_blocks = min(self.stored_blocks, got)
        if side is ReadSide.DE and flow.networked and got:  # DE buffer → PE node, over the CNIC
            with flow.stats.time_stage("cnic_hits"):
                await self._push(node, self.de_slots[:got], self._node(a.pe), self.pe_slots[:got])

    def _write(self, node: int, op: dict[str, Any]) -> asyncio.Future[Any]:
        """Node ``node``'s side-car starts ``op``, which writes into the request's slots (or
        ends a hand-over that does); the lease goes back only once it is over."""
        flow = self.flow
        future = flow.off_loop(flow.ask_sidecar, flow.dep.nodes[node].control, op)
        self._writes.add(future)
        future.add_done_callback(self._written)
        return future

    def _written(self, future: asyncio.Future[Any]) -> None:
        self._writes.discard(future)
        if not future.cancelled():
            future.exception()  # (its asker, if any, sees it: none may be left to)

    async def _side_car(self, node: int, op: dict[str, Any], failed: str) -> dict[str, Any]:
        """Node ``node``'s side-car carries out ``op``, which writes into the request's slots.
        Cancelled (the client left), it goes on: the lease goes back once it is over."""
        return await self._answer(self._write(node, op), failed)

    @staticmethod
    async def _answer(future: asyncio.Future[Any], failed: str) -> dict[str, Any]:
        try:
            answer: dict[str, Any] = await asyncio.shield(future)
        except (OSError, ValueError) as err:
            raise FlowError(503, f"{failed}: {err}") from None
        return answer

    def _push_op(self, slots: list[int], to_node: int, to_slots: list[int]) -> dict[str, Any]:
        to = self.flow.dep.nodes[to_node].control
        return {"op": "push", "slots": slots, "to": to, "to_slots": to_slots}

    async def _push(self, node: int, slots: list[int], to_node: int, to_slots: list[int]) -> None:
        """Node ``node``'s side-car writes ``slots`` into node ``to_node``'s ``to_slots`` over
        the compute network."""
        if not slots:
            return
        op = self._push_op(slots, to_node, to_slots)
        await self._side_car(node, op, f"KV transfer node {node} → node {to_node} failed")

    @property
    def _handover_job(self) -> str:
        return f"{self.flow.boot}:{self.lease.tag}"

    def _handed_op(self, slots: list[int]) -> dict[str, Any]:
        """Close the layerwise hand-over (``cnic.ComputeNic.handed``): which of ``slots``
        did not land whole."""
        return {"op": "handed", "job": self._handover_job, "slots": slots}

    # ------------------------------------------------------------ 2. prefill
    def prefill_params(self) -> dict[str, Any]:
        flow, a, hit = self.flow, self.placed, self.hit_blocks
        bs, lease = flow.dep.block_tokens, self.lease.tag
        de_node, pe_node = self._node(a.de), self._node(a.pe)
        if flow.networked:  # only its own node's buffer: the hits are there, the rest goes there
            own = BlockLoad(pe_node, tuple(self.pe_slots[:hit]), hit * bs, lease) if hit else None
            forward = None
            if flow.layerwise:  # each saved layer on to the DE buffer as it is saved
                forward = BlockForward(de_node, tuple(self.de_slots[hit:]), self._handover_job)
                self._forward_open = True
            own_save = BlockSave(pe_node, tuple(self.pe_slots[hit:]), hit, lease, forward)
            return {"dualpath": TransferParams(load=own, save=own_save).to_dict()}
        load = None
        if hit:
            if self.pe_slots:  # PE read path: from the PE's own buffer
                load = BlockLoad(pe_node, tuple(self.pe_slots[:hit]), hit * bs, lease)
            else:  # DE read path: from the DE buffer, over the compute network
                load = BlockLoad(de_node, tuple(self.de_slots[:hit]), hit * bs, lease)
        first = 0 if self.pe_slots or not hit else hit  # DE path: the DE already has the hits
        save = BlockSave(de_node, tuple(self.de_slots[first:]), first, lease)
        return {"dualpath": TransferParams(load=load, save=save).to_dict()}

    def prefilling(self) -> None:
        """The request is on its way to the prefill instance (its pass, as the ledger sees
        it: vLLM chunks the prompt itself). Across nodes on the PE read path, with the
        layerwise hand-over, the hits go on to the DE buffer meanwhile (they are in the PE
        buffer since the read)."""
        flow, a = self.flow, self.placed
        assert self.turn is not None
        now = self.turn.prefill_start_s = flow.now()
        flow.core.pass_started(self.turn, now)
        if flow.layerwise and a.read_side is ReadSide.PE and self.hit_blocks:
            hit, de_node = self.hit_blocks, self._node(a.de)
            op = self._push_op(self.pe_slots[:hit], de_node, self.de_slots[:hit])
            self._hits = self._write(self._node(a.pe), op)

    # ------------------------------------------------------------ 3. the prefill's KV
    async def hand_over(self) -> None:
        """Across nodes, after the prefill answered: its KV in the DE buffer (the blocks the
        DE buffer lacks: on the DE read path it holds the hits already). Layerwise (the
        default), the PE node's side-car pushed each layer as it was saved: the router
        closes that hand-over (``cnic.ComputeNic.handed``), pushes whole what did not land,
        and waits for the PE read path's hits, pushed while the prefill ran. Otherwise
        every block goes now, over the compute network. One host: nothing to do (the
        prefill saved into the DE buffer)."""
        if not self.flow.networked:
            return
        a, hit = self.placed, self.hit_blocks
        pe_node, de_node = self._node(a.pe), self._node(a.de)
        if not self._forward_open:
            first = hit if a.read_side is ReadSide.DE else 0
            await self._push(pe_node, self.pe_slots[first:], de_node, self.de_slots[first:])
            return
        self._forward_open = False
        failed = f"KV transfer node {pe_node} → node {de_node} failed"
        answer = await self._side_car(pe_node, self._handed_op(self.pe_slots[hit:]), failed)
        missing = [hit + int(i) for i in answer["missing"]]
        src, dst = [self.pe_slots[i] for i in missing], [self.de_slots[i] for i in missing]
        await self._push(pe_node, src, de_node, dst)
        if self._hits is not None:
            await self._answer(self._hits, failed)

    async def persist_prompt(self) -> None:
        """Across nodes, once the prefill answered: the prompt's blocks the store lacks are
        persisted by the node the policy names (``PolicyCore.write_node``). The PE node holds
        them in its buffer then, as the DE node does after the hand-over: the PE's side-car
        takes the slots over from the lease and writes them through its SNIC (the decode then
        persists only what its generation fills); otherwise the decode persists them from its
        buffer, as on one host. A PE side-car that cannot take them leaves them to the
        decode."""
        flow = self.flow
        full = len(self.tokens) // flow.dep.block_tokens
        new = full - self.stored_blocks
        if new <= 0:
            return
        pe_node, de_node = self._node(self.placed.pe), self._node(self.placed.de)
        writer = de_node
        if flow.networked and len(self.pe_slots) >= full:
            writer = flow.policy.write_node(pe_node, de_node, flow.written)
        if writer == pe_node:
            op = {
                "op": "write",
                "keys": self.keys[self.stored_blocks : full],
                "slots": self.pe_slots[self.stored_blocks : full],
                "owner": self.lease.tag,
            }
            try:
                answer = await flow.off_loop(flow.ask_sidecar, flow.dep.nodes[pe_node].control, op)
                self.prompt_written = int(answer["queued"]) == new
            except (OSError, ValueError) as err:
                print(
                    f"dualpath router: node {pe_node}'s side-car did not take {new} block(s) "
                    f"to persist ({err}): node {de_node} persists them",
                    file=sys.stderr,
                    flush=True,
                )
        flow.written[pe_node if self.prompt_written else de_node] += new * flow.full_block_bytes

    def prefilled(self) -> None:
        """The prefill answered: its KV is in the DE buffer; the PE buffer's slots are free."""
        flow, a, turn = self.flow, self.placed, self.turn
        assert turn is not None
        # on one host only the PE read path holds PE slots
        de_path = a.read_side is ReadSide.DE if flow.networked else not self.pe_slots
        self.lease.give_back(self._node(a.pe))
        self.pe_slots = []
        flow.prefilled(de_path, self.hit_blocks, len(self.de_slots))
        flow.core.first_token(turn, flow.now())
        flow.pull()

    # ------------------------------------------------------------ 4. decode
    def decode_params(self, tenant: str, choices: int = 1) -> dict[str, Any]:
        """``choices``: the request's ``n`` (vLLM runs each choice as a request that loads
        the same slots: ``BlockLoad.shares``)."""
        flow = self.flow
        de_node = self._node(self.placed.de)
        load = BlockLoad(de_node, tuple(self.de_slots), len(self.tokens), self.lease.tag, choices)
        first = len(self.tokens) // flow.dep.block_tokens if self.prompt_written else None
        persist = BlockPersist(
            de_node, self.stored_blocks if first is None else first, flow.dep.namespace(tenant)
        )
        return {"dualpath": TransferParams(load=load, persist=persist).to_dict()}

    def decoding(self) -> None:
        """The decode's first bytes arrived: it claimed the DE slots when it loaded them."""
        flow, turn = self.flow, self.turn
        assert turn is not None
        if self.de_slots:
            flow.counters.moved(
                KVPath.DE_BUFFER_TO_DE_HBM, len(self.de_slots) * flow.full_block_bytes
            )
        turn.second_token_s = turn.first_token_s if turn.output_tokens == 1 else flow.now()
        flow.stats.prompt_tokens += turn.prompt_tokens
        flow.stats.hit_tokens += self.hit_blocks * flow.dep.block_tokens

    def generated(self, num_tokens: int) -> None:
        """The decode sent ``num_tokens`` more tokens of the answer (the policy's tok_e)."""
        if num_tokens > 0 and self.turn is not None and not self.turn.phase.over:
            self.num_generated += num_tokens
            self.flow.core.generated_tokens(self.turn.de, num_tokens)

    # ------------------------------------------------------------ 5. the one exit
    def close(self, outcome: Outcome) -> None:
        """The request ends (at most once): the turn leaves the core's counts, finished or
        aborted (queued: at the next pull, which drops it), and the lease goes back, now or,
        while a side-car still writes into its slots, once that is over."""
        if self.closed:
            return
        self.closed = True
        flow, turn = self.flow, self.turn
        if turn is not None:
            if self.num_generated:  # the turn leaves its DE: its tokens leave the count
                flow.core.generated_tokens(turn.de, -self.num_generated)
            if outcome is Outcome.ANSWERED and self.assign is not None:
                bs = flow.dep.block_tokens
                filled = (len(self.tokens) + self.num_generated) // bs - len(self.tokens) // bs
                flow.written[self._node(turn.de)] += filled * flow.full_block_bytes
                turn.finish_s = flow.now()
                flow.core.finish(turn, turn.finish_s)
                flow.core.forget(turn.request_id)
                flow.stats.num_done += 1
            elif not turn.phase.over:
                flow.unplace(turn)
                if flow.core.cancel(turn, flow.now()):
                    flow.core.abort(turn, flow.now())
                    flow.core.forget(turn.request_id)
                flow.stats.num_aborted += 1
            self.num_generated = 0
        if self._forward_open:  # no transfer of its hand-over may land after its slots went
            self._forward_open = False
            pe_node = self._node(self.placed.pe)
            self._write(pe_node, self._handed_op([]))
        writes = [w for w in self._writes if not w.done()]
        if writes:
            gathered = asyncio.gather(*writes, return_exceptions=True)
            gathered.add_done_callback(lambda _: self.lease.close())
        else:
            self.lease.close()
        self.de_slots, self.pe_slots = [], []
        flow.pull()
