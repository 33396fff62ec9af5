"""The DualPath shell over vLLM instances: one request's way from the router to its answer.

The third shell around the policy core (after the simulator and our runtime): it reports to the
shared ``ledger.Core`` what happened to each turn, as the other two do (its lifecycle: submit,
pull, read, pass, first token, finish or abort), and carries out what ``PolicyCore`` decided,
nothing more. Per request (design §4):

1. tokens (the prefill instance's ``/tokenize``, so they are exactly vLLM's) → the store's hit
   prefix (Full Blocks, per-tenant namespace; blocks of the prefix still queued for a write at
   a DE node's side-car are waited for first, as the runtime's ``Durability`` does: the turn
   before wrote them behind its answer) → a turn submitted; the policy picks PE, DE and
   the read side from the view the runtime's reads (seq_e, tok_e, read_q per SNIC, free HBM),
   but a DE's free HBM is its ``hbm_tokens`` less what its turns reserve until they finish:
   vLLM's own free KV is not read, so the shell never reports ``loaded``;
2. slots in the DE buffer for the whole prompt; the hit blocks read from storage into the PE
   buffer (PE read path) or straight into the first of those DE slots (DE read path), by that
   node's side-car, through its SNIC;
3. the prefill instance runs with ``max_tokens`` 1: it loads the hits layer by layer (from its
   own node's buffer, or from the DE node's over the compute network), and saves each layer's
   KV into the DE slots (all blocks on the PE path, only the new ones on the DE path);
4. the decode instance loads the whole prompt from its buffer, persists the blocks the store
   lacks, and streams the answer (vLLM recomputes the last prompt token and samples from it,
   as in vLLM's own disaggregated flow), persisting each block its generation fills.

Across nodes (``NodeSpec.host``: machines, or the network namespaces of ``dualpath cluster
up``) no process touches another node's memory: the router allocates slots through each node's
side-car, the prefill loads and saves only its own node's buffer (the request also holds PE
slots for its whole prompt there), and the side-cars move the KV over the compute network
(``push``, Mooncake Transfer Engine): on the DE read path the hit blocks DE buffer → PE node
before the prefill, and after it the new blocks PE node → DE buffer (on the PE read path every
block: the hits too).

A failed step ends the request with a clean error (nothing half-written is ever a hit: blocks
become hits only once durable); the turn leaves every counter it was in.

Slots are leased, never handed over blindly: the request's PE and DE slots are allocated
under its lease tag (``SlotBuffer`` owner tags); the decode instance claims its DE slots when
it loads them (``plan.StepPlanner``), and the request's one exit (``finish`` or ``release``)
frees whatever is still under its lease. A client that leaves before the decode loaded, a
decode that never got scheduled, a timeout: the slots come back either way, and a claim that
comes too late finds no lease and recomputes instead of reading reused slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dualpath.integrations.vllm.node import NodeSpec, RemoteSlots, SidecarPool, attach_buffer
from dualpath.integrations.vllm.params import BlockLoad, BlockPersist, BlockSave, TransferParams
from dualpath.integrations.vllm.setup import Deployment
from dualpath.integrations.vllm.slotqueue import SlotQueue
from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.store import block_keys
from dualpath.kv.stores import open_store
from dualpath.ledger import Core, Phase, Topology
from dualpath.ledger.core import Read
from dualpath.ledger.counters import VLLM_PATHS
from dualpath.ledger.turn import Turn, usable_hit_tokens
from dualpath.policy import Assign
from dualpath.policy.base import Policy
from dualpath.policy.core import PolicyCore
from dualpath.policy.forced import ForcedSide
from dualpath.types import EngineKind, KVPath, ReadSide

SLOT_DEADLINE_S = 300.0  # and at most this long (the router passes its request timeout)
# A new turn waits at most this long for writes of its prefix still queued at a DE node's
# side-car (a fault, or a SNIC far behind: then it goes with what is durable and recomputes)
SETTLE_WAIT_S = 10.0
# A prefill cut off before it answered (a timeout, its client gone) may still be inside a step
# that saves into the request's DE slots: they go back this much later (a step on the tiny
# model takes milliseconds; a long prefill chunk on a real model, well under a second)
PREFILL_GRACE_S = 5.0
# Threads for side-car requests: one per request waiting on a side-car at most (a storage read
# holds one for as long as its SNIC takes); beyond that, requests wait for a thread
SIDECAR_THREADS = 256
T = TypeVar("T")


class FlowError(Exception):
    """A request cannot be served: ``status`` and a one-line message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(slots=True)
class Prepared:
    """A turn placed by the policy, its hit KV in a buffer, ready for its prefill."""

    turn: Turn
    tokens: list[int]
    assign: Assign
    hit_blocks: int  # leading blocks loaded from a buffer (read from storage)
    stored_blocks: int  # leading blocks the store holds (the decode persists the rest)
    de_slots: list[int]
    lease: int  # the owner tag of its slots until the decode claims the DE ones
    keys: list[str] = field(default_factory=list)  # of the prompt's Full Blocks
    pe_slots: list[int] = field(default_factory=list)
    prompt_written: bool = False  # its PE node persists the new prompt blocks (not the DE)
    num_generated: int = 0  # tokens its decode reported so far (the core counts them per DE)
    # what may still write into its slots after the router gave up on it: a storage read's
    # thread, a prefill not yet answered; its slots go back once that is over
    reading: asyncio.Future[Any] | None = None
    prefill_in_flight: bool = False


@dataclass(slots=True)
class FlowStats:
    """What only the router counts (bytes per path are the core's: ``core.counters``)."""

    reads_by_side: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    num_done: int = 0
    num_aborted: int = 0  # turns that failed or whose client left
    settle_failures: int = 0  # a DE side-car that could not say what it still writes
    settle_timeouts: int = 0  # writes of a prefix still queued after SETTLE_WAIT_S
    stage_s: dict[str, float] = field(default_factory=dict)  # seconds spent per router stage

    @contextlib.contextmanager
    def time_stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_s[name] = self.stage_s.get(name, 0.0) + time.perf_counter() - start


def _no_agents(agent: object, arrival_s: float) -> None:
    raise AssertionError("the vLLM shell submits each request itself: it drives no agents")


class TurnFlow:
    """The core (ledger, policy, turn table), the node buffers and side-cars of one
    deployment."""

    def __init__(
        self,
        dep: Deployment,
        policy: PolicyCore,
        kv_root: str,
        sidecar: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
        force_side: ReadSide | None = None,
        slot_deadline_s: float = SLOT_DEADLINE_S,
    ) -> None:
        """``sidecar``: how side-cars are asked (default: a ``SidecarPool``'s kept
        connections); ``force_side``: every read from that side, whatever the policy chose
        (``ForcedSide``); ``slot_deadline_s``: how long a request waits for buffer slots
        (then a 503 naming the node)."""
        self.dep = dep
        self.policy = policy  # for its decision trace (the router's /v1/dualpath/decisions)
        self.topology = Topology(1, dep.num_prefill, dep.num_decode)
        self._forced = ForcedSide(policy, force_side)
        decide: Policy = self._forced
        self.core: Core[Any, Turn] = Core(
            self.topology, decide, dep.hbm_tokens, dep.block_tokens, _no_agents, paths=VLLM_PATHS
        )
        self.counters = self.core.counters  # KV bytes per load path
        self.core.count_generated()  # tok_e per DE, as the other shells report it
        spec0 = dep.nodes[0]
        # the store's index: the files at kv_root, or the master of a store across the network
        self.store = open_store(
            spec0.store_url or kv_root,
            spec0.layout,
            dep.namespace(""),
            local_hostname=dep.router_store_host,
        )
        self.networked = any(n.networked for n in dep.nodes)
        self._pool = SidecarPool() if sidecar is None else None
        ask: Callable[[str, dict[str, Any]], dict[str, Any]] = (
            self._pool.call if self._pool is not None else sidecar  # type: ignore[assignment]
        )
        self.buffers: dict[int, SlotBuffer | RemoteSlots] = {
            n.node: RemoteSlots(n, ask) if n.networked else attach_buffer(n) for n in dep.nodes
        }
        self.full_block_bytes = spec0.layout.full_block_bytes
        self._sidecar = ask
        self._ids = itertools.count()
        self._placed: dict[int, asyncio.Future[tuple[Assign, list[Read]]]] = {}
        self._epoch = time.monotonic()
        self.slot_deadline_s = slot_deadline_s
        self._calls = ThreadPoolExecutor(SIDECAR_THREADS, thread_name_prefix="sidecar-call")
        self.stats = FlowStats()
        self._slot_queues: dict[int, SlotQueue] = {}  # per node: requests waiting for slots
        # bytes given to each node's SNIC to write (the write side's balance, ``persist_prompt``)
        self.written: dict[int, float] = {n.node: 0.0 for n in dep.nodes}
        # the side-cars that may hold queued writes: the DE nodes', and across nodes the PE
        # nodes' too (they persist prompts: ``persist_prompt``)
        self._writers = [n for n in dep.nodes if n.kind == EngineKind.DE.value or self.networked]

    def _off_loop(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` (a side-car request: it blocks) on the flow's own threads. Not
        asyncio's default executor: its few threads (CPUs + 4) would all sit in storage reads
        that last seconds on a slow SNIC while the short requests (slots, KV pushes, settle)
        of other requests queue behind them."""
        return asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    @property
    def read_side(self) -> ReadSide | None:
        """The side every read is forced to (None: the policy's choice)."""
        return self._forced.side

    @read_side.setter
    def read_side(self, side: ReadSide | None) -> None:
        self._forced.side = side

    def now(self) -> float:
        return time.monotonic() - self._epoch

    # ------------------------------------------------------------ 1. place
    async def place(self, tokens: list[int], max_tokens: int, tenant: str) -> Prepared:
        bs = self.dep.block_tokens
        self._check_fits(len(tokens))
        keys = block_keys(tokens, bs, self.dep.namespace(tenant))
        # the store's index off the event loop: files to stat, or a master across the network
        with self.stats.time_stage("lookup"):
            stored = await self._off_loop(self.store.lookup, keys) // bs
        usable = (len(tokens) - 1) // bs  # usable_hit_tokens' cap
        if stored < usable and await self._settle(keys[stored:usable]):
            with self.stats.time_stage("lookup"):
                stored = await self._off_loop(self.store.lookup, keys) // bs
        hit_tokens = usable_hit_tokens(stored * bs, len(tokens), bs)
        rid = next(self._ids)
        turn = Turn(rid, 0, 0, len(tokens), hit_tokens, max(1, max_tokens), self.now())
        placed: asyncio.Future[tuple[Assign, list[Read]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._placed[rid] = placed
        self.core.submit(turn, self.now())
        self._pull()
        try:
            assign, reads = await placed
        except BaseException:  # its client left: aborted now, or (queued) at the next pull
            self._placed.pop(rid, None)
            self.abort(turn)
            raise
        hit_blocks = hit_tokens // bs
        lease = rid + 1  # > 0: instances' tags are < 0, anonymous slots 0
        need = -(-len(tokens) // bs)
        de_node, pe_node = self.topology.node_of(assign.de), self.topology.node_of(assign.pe)
        try:
            # across nodes the prefill's KV goes to its own node's buffer first: both nodes'
            # slots asked for at once (two side-cars, one round trip's time)
            de_slots, pe_slots = await self._alloc_both(
                de_node, pe_node if self.networked else None, need, lease
            )
        except BaseException:
            self.abort(turn)
            raise
        prep = Prepared(turn, tokens, assign, hit_blocks, stored, de_slots, lease, keys)
        prep.pe_slots = pe_slots
        try:
            await self._read(prep, keys[:hit_blocks], reads)
        except BaseException:
            self.release(prep)
            raise
        return prep

    async def _settle(self, keys: list[str]) -> bool:
        """Wait until no DE node's side-car has ``keys`` queued for a write; whether one had
        (then look the hits up again). A side-car that does not answer holds nothing back: its
        node's reads fail on their own."""

        def ask(spec: NodeSpec) -> bool:
            op = {"op": "settle", "keys": keys, "timeout_s": SETTLE_WAIT_S}
            try:
                answer = self._sidecar(spec.control, op)
            except (OSError, ValueError) as err:  # counted and said, never skipped silently
                self.stats.settle_failures += 1
                print(
                    f"dualpath router: node {spec.node}'s side-car did not say whether "
                    f"{len(keys)} block(s) are still being written ({err}): the turn goes "
                    "with what the store holds",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            if answer.get("pending"):  # still queued after SETTLE_WAIT_S: a SNIC far behind
                self.stats.settle_timeouts += 1
            return bool(answer.get("waited"))

        with self.stats.time_stage("settle"):
            waited = await asyncio.gather(*(self._off_loop(ask, n) for n in self._writers))
        return any(waited)

    def _pull(self) -> None:
        """A pull (design §7.1): the policy places what it can; each waiter learns its place."""
        for turn, reads in self.core.pull(self.now()):
            a = Assign(
                turn.request_id,
                turn.pe,
                turn.de,
                turn.read_side,
                turn.pe_read_tokens,
                turn.de_read_tokens,
            )
            waiter = self._placed.pop(turn.request_id)
            if not waiter.done():  # else its client just left: ``place`` aborts the turn
                waiter.set_result((a, reads))

    def _check_fits(self, num_tokens: int) -> None:
        """A prompt that no node buffer can hold is refused at once (it would wait forever)."""
        need = -(-num_tokens // self.dep.block_tokens)
        cap = min(n.num_slots for n in self.dep.nodes)
        if need > cap:
            raise FlowError(
                400,
                f"the prompt has {num_tokens} tokens: a node buffer holds "
                f"{cap * self.dep.block_tokens} (raise --vllm-buffer-mib)",
            )

    async def _alloc(self, node: int, num_slots: int, lease: int) -> list[int]:
        """``num_slots`` slots of ``node``'s buffer under ``lease``, waiting in the node's
        queue while it is full (at most ``slot_deadline_s``: then a 503 naming the buffer)."""
        queue = self._slot_queues.get(node)
        if queue is None:
            queue = self._slot_queues[node] = SlotQueue(
                lambda n, lease: self._try_alloc(node, n, lease),
                lambda slots, lease: self._release(node, slots, lease),
            )
        try:
            with self.stats.time_stage("slot_wait"):
                async with asyncio.timeout(self.slot_deadline_s):
                    return await queue.alloc(num_slots, lease)
        except TimeoutError:
            raise FlowError(
                503,
                f"no {num_slots} free slots in node {node}'s buffer within "
                f"{self.slot_deadline_s:g} s",
            ) from None

    async def _alloc_both(
        self, de_node: int, pe_node: int | None, num_slots: int, lease: int
    ) -> tuple[list[int], list[int]]:
        """``num_slots`` slots of the DE node's buffer and (``pe_node`` given) of the PE
        node's, asked for together; if either fails, what the other got goes back."""
        if pe_node is None:
            return await self._alloc(de_node, num_slots, lease), []
        asks = [
            asyncio.ensure_future(self._alloc(node, num_slots, lease))
            for node in (de_node, pe_node)
        ]

        def give_back() -> None:  # what either got goes back once its ask is over
            for node, ask in zip((de_node, pe_node), asks, strict=True):
                ask.cancel()
                ask.add_done_callback(functools.partial(self._unasked_slots, node, lease=lease))

        try:
            await asyncio.wait(asks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            give_back()
            raise
        failed = next((a for a in asks if a.done() and a.exception() is not None), None)
        if failed is not None:
            give_back()
            await asyncio.gather(*asks, return_exceptions=True)
            raise failed.exception()  # type: ignore[misc]
        return asks[0].result(), asks[1].result()

    def _unasked_slots(self, node: int, done: asyncio.Future[list[int]], *, lease: int) -> None:
        """An allocation whose request failed or left: its slots, if it got any, go back."""
        if not done.cancelled() and done.exception() is None and done.result():
            self._release(node, done.result(), lease)

    @property
    def slot_waiters(self) -> int:
        """Requests waiting for buffer slots now."""
        return sum(len(q) for q in self._slot_queues.values())

    async def _try_alloc(self, node: int, num_slots: int, lease: int) -> list[int] | None:
        """One try, off the event loop (a buffer's lock is shared with other processes; a
        networked node's side-car is asked): the slots, None if the buffer is full; a
        side-car that cannot be asked fails the request (503)."""
        buf = self.buffers[node]
        asked = self._off_loop(buf.alloc, num_slots, lease)
        try:
            return await asyncio.shield(asked)
        except (OSError, ValueError) as err:
            raise FlowError(503, f"node {node}'s side-car: {err}") from None
        except asyncio.CancelledError:  # what the thread still allocates goes back
            asked.add_done_callback(lambda f: self._unasked(buf, f, lease))
            raise

    @staticmethod
    def _unasked(buf: SlotBuffer | RemoteSlots, done: asyncio.Future[Any], lease: int) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            buf.release(done.result(), lease)

    # ------------------------------------------------------------ 2. read
    async def _read(self, prep: Prepared, keys: list[str], reads: list[Read]) -> None:
        """The storage read the core gave the turn (``Core.pull``: node, tokens): its blocks
        into the PE buffer (PE read path) or the first of its DE slots (DE read path)."""
        turn, a = prep.turn, prep.assign
        if not reads:
            return
        if len(reads) > 1:  # serve_vllm refuses split_reads at start
            raise FlowError(500, "split reads are not supported by the vLLM engine")
        ((node, tokens),) = reads
        keys = keys[: tokens // self.dep.block_tokens]
        side = a.read_side
        if side is ReadSide.PE:
            if not self.networked:
                prep.pe_slots = await self._alloc(node, len(keys), prep.lease)
            slots = prep.pe_slots[: len(keys)]
        else:
            slots = prep.de_slots[: len(keys)]
        nbytes = len(keys) * self.full_block_bytes
        self.core.read_started(turn, node, nbytes, self.now())
        spec = self.dep.nodes[node]
        try:
            op = {"op": "read", "keys": keys, "slots": slots}
            prep.reading = asyncio.ensure_future(self._off_loop(self._sidecar, spec.control, op))
            with self.stats.time_stage("storage_read"):
                answer = await asyncio.shield(prep.reading)  # cancelled: the read goes on
            prep.reading = None
        except (OSError, ValueError) as err:
            prep.reading = None
            raise FlowError(503, f"storage read on node {node} failed: {err}") from None
        finally:
            if turn.phase is Phase.READING:
                self.core.read_done(turn, node, self.now())
        got = int(answer["num_ok"])
        path = KVPath.STORAGE_TO_PE_BUFFER if side is ReadSide.PE else KVPath.STORAGE_TO_DE_BUFFER
        self.counters.moved(path, got * self.full_block_bytes)
        self.stats.reads_by_side[side.value] = self.stats.reads_by_side.get(side.value, 0) + 1
        if got < prep.hit_blocks:  # a block went missing or was corrupt: recompute from there
            prep.hit_blocks = got
            prep.stored_blocks = min(prep.stored_blocks, got)
        if side is ReadSide.DE and self.networked and got:  # DE buffer → PE node, over the CNIC
            pe_node = self.topology.node_of(a.pe)
            with self.stats.time_stage("cnic_hits"):
                await self._push(prep, node, prep.de_slots[:got], pe_node, prep.pe_slots[:got])

    async def _push(
        self, prep: Prepared, node: int, slots: list[int], to_node: int, to_slots: list[int]
    ) -> None:
        """Node ``node``'s side-car writes ``slots`` into node ``to_node``'s ``to_slots`` over
        the compute network. Cancelled (the client left), it goes on: the request's slots go
        back once it is over (``Prepared.reading``)."""
        if not slots:
            return
        op = {
            "op": "push",
            "slots": slots,
            "to": self.dep.nodes[to_node].control,
            "to_slots": to_slots,
        }
        prep.reading = asyncio.ensure_future(
            self._off_loop(self._sidecar, self.dep.nodes[node].control, op)
        )
        try:
            await asyncio.shield(prep.reading)
        except (OSError, ValueError) as err:
            prep.reading = None
            raise FlowError(
                503, f"KV transfer node {node} → node {to_node} failed: {err}"
            ) from None
        prep.reading = None

    # ------------------------------------------------------------ 3. prefill, 4. decode
    def prefill_params(self, prep: Prepared) -> dict[str, Any]:
        a, hit = prep.assign, prep.hit_blocks
        de_node = self.topology.node_of(a.de)
        if self.networked:  # only its own node's buffer: the hits are there, the rest goes there
            pe_node, bs = self.topology.node_of(a.pe), self.dep.block_tokens
            own = BlockLoad(pe_node, tuple(prep.pe_slots[:hit]), hit * bs) if hit else None
            own_save = BlockSave(pe_node, tuple(prep.pe_slots[hit:]), hit)
            return {"dualpath": TransferParams(load=own, save=own_save).to_dict()}
        load = None
        if hit:
            if prep.pe_slots:  # PE read path: from the PE's own buffer
                load = BlockLoad(
                    self.topology.node_of(a.pe),
                    tuple(prep.pe_slots[:hit]),
                    hit * self.dep.block_tokens,
                )
            else:  # DE read path: from the DE buffer, over the compute network
                load = BlockLoad(de_node, tuple(prep.de_slots[:hit]), hit * self.dep.block_tokens)
        first = 0 if prep.pe_slots or not hit else hit  # DE path: the DE already has the hits
        save = BlockSave(de_node, tuple(prep.de_slots[first:]), first)
        return {"dualpath": TransferParams(load=load, save=save).to_dict()}

    async def hand_over(self, prep: Prepared) -> None:
        """Across nodes, after the prefill answered: its KV from the PE node's buffer into the
        DE buffer over the compute network (the blocks the DE buffer lacks: on the DE read
        path it holds the hits already). One host: nothing to do (the prefill saved there)."""
        if not self.networked:
            return
        a = prep.assign
        first = prep.hit_blocks if a.read_side is ReadSide.DE else 0
        pe_node, de_node = self.topology.node_of(a.pe), self.topology.node_of(a.de)
        await self._push(prep, pe_node, prep.pe_slots[first:], de_node, prep.de_slots[first:])

    async def persist_prompt(self, prep: Prepared) -> None:
        """Across nodes, once the prefill answered: the prompt's blocks the store lacks are
        persisted by the node the policy names (``PolicyCore.write_node``). The PE node holds
        them in its buffer then, as the DE node does after the hand-over: the PE's side-car
        takes the slots over from the request's lease and writes them through its SNIC (the
        decode then persists only what its generation fills); otherwise the decode persists
        them from its buffer, as on one host. A PE side-car that cannot take them leaves them
        to the decode."""
        bs, nbytes = self.dep.block_tokens, self.full_block_bytes
        full = len(prep.tokens) // bs
        new = full - prep.stored_blocks
        if new <= 0:
            return
        pe_node, de_node = (
            self.topology.node_of(prep.assign.pe),
            self.topology.node_of(prep.assign.de),
        )
        writer = de_node
        if self.networked and len(prep.pe_slots) >= full:
            writer = self.policy.write_node(pe_node, de_node, self.written)
        if writer == pe_node:
            op = {
                "op": "write",
                "keys": prep.keys[prep.stored_blocks : full],
                "slots": prep.pe_slots[prep.stored_blocks : full],
                "owner": prep.lease,
            }
            try:
                answer = await self._off_loop(self._sidecar, self.dep.nodes[pe_node].control, op)
                prep.prompt_written = int(answer["queued"]) == new
            except (OSError, ValueError) as err:
                print(
                    f"dualpath router: node {pe_node}'s side-car did not take {new} block(s) "
                    f"to persist ({err}): node {de_node} persists them",
                    file=sys.stderr,
                    flush=True,
                )
        self.written[pe_node if prep.prompt_written else de_node] += new * nbytes

    def prefilling(self, prep: Prepared) -> None:
        """The request is on its way to the prefill instance (its pass, as the ledger sees
        it: vLLM chunks the prompt itself)."""
        prep.prefill_in_flight = True
        now = prep.turn.prefill_start_s = self.now()
        self.core.pass_started(prep.turn, now)

    def prefilled(self, prep: Prepared) -> None:
        """The prefill answered: its KV is in the DE buffer; the PE buffer's slots are free."""
        prep.prefill_in_flight = False
        bs_bytes = self.full_block_bytes
        # on one host only the PE read path holds PE slots
        de_path = prep.assign.read_side is ReadSide.DE if self.networked else not prep.pe_slots
        if prep.pe_slots:
            self._give_back(prep.assign.pe, prep.pe_slots, prep.lease)
            prep.pe_slots = []
        if de_path:
            self.counters.moved(KVPath.DE_BUFFER_TO_PE_HBM, prep.hit_blocks * bs_bytes)
            saved = len(prep.de_slots) - prep.hit_blocks
        else:
            self.counters.moved(KVPath.PE_BUFFER_TO_PE_HBM, prep.hit_blocks * bs_bytes)
            saved = len(prep.de_slots)
        self.counters.moved(KVPath.PE_HBM_TO_DE_BUFFER, saved * bs_bytes)
        self.core.first_token(prep.turn, self.now())
        self._pull()

    def decode_params(self, prep: Prepared, tenant: str, choices: int = 1) -> dict[str, Any]:
        """``choices``: the request's ``n`` (vLLM runs each choice as a request that loads
        the same slots: ``BlockLoad.shares``)."""
        de_node = self.topology.node_of(prep.assign.de)
        load = BlockLoad(de_node, tuple(prep.de_slots), len(prep.tokens), prep.lease, choices)
        first = len(prep.tokens) // self.dep.block_tokens if prep.prompt_written else None
        persist = BlockPersist(
            de_node,
            prep.stored_blocks if first is None else first,
            self.dep.namespace(tenant),
        )
        return {"dualpath": TransferParams(load=load, persist=persist).to_dict()}

    def decoding(self, prep: Prepared) -> None:
        """The decode's first bytes arrived: it claimed the DE slots when it loaded them."""
        if prep.de_slots:
            self.counters.moved(
                KVPath.DE_BUFFER_TO_DE_HBM, len(prep.de_slots) * self.full_block_bytes
            )
        turn = prep.turn
        turn.second_token_s = turn.first_token_s if turn.output_tokens == 1 else self.now()
        self.stats.prompt_tokens += prep.turn.prompt_tokens
        self.stats.hit_tokens += prep.hit_blocks * self.dep.block_tokens

    def generated(self, prep: Prepared, num_tokens: int) -> None:
        """The decode sent ``num_tokens`` more tokens of the answer (the policy's tok_e)."""
        if num_tokens > 0 and not prep.turn.phase.over:
            prep.num_generated += num_tokens
            self.core.generated_tokens(prep.turn.de, num_tokens)

    def _ungenerate(self, prep: Prepared) -> None:
        """The turn left its DE: its tokens leave the DE's count with it."""
        if prep.num_generated:
            self.core.generated_tokens(prep.turn.de, -prep.num_generated)
            prep.num_generated = 0

    def finish(self, prep: Prepared) -> None:
        self._give_back_all(prep)
        bs = self.dep.block_tokens
        filled = (len(prep.tokens) + prep.num_generated) // bs - len(prep.tokens) // bs
        self.written[self.topology.node_of(prep.assign.de)] += filled * self.full_block_bytes
        self._ungenerate(prep)
        turn = prep.turn
        now = turn.finish_s = self.now()
        self.core.finish(turn, now)
        self.core.forget(turn.request_id)
        self.stats.num_done += 1
        self._pull()

    def release(self, prep: Prepared) -> None:
        """The request failed or its client left: its slots back, the turn out of every count."""
        self._give_back_all(prep)
        self._ungenerate(prep)
        self.abort(prep.turn)

    def _give_back_all(self, prep: Prepared) -> None:
        """Every slot still under the request's lease (the decode's claimed ones are not),
        now, or once what may still write into them is over (``Prepared.reading``,
        ``prefill_in_flight``)."""
        if prep.reading is not None and not prep.reading.done():
            later = self._detach_slots(prep)
            prep.reading.add_done_callback(lambda _: later())
            return
        if prep.prefill_in_flight:
            prep.prefill_in_flight = False
            with contextlib.suppress(RuntimeError):  # no loop (a plain call): at once
                asyncio.get_running_loop().call_later(PREFILL_GRACE_S, self._detach_slots(prep))
                return
        if prep.pe_slots:
            self._give_back(prep.assign.pe, prep.pe_slots, prep.lease)
            prep.pe_slots = []
        if prep.de_slots:
            self._give_back(prep.assign.de, prep.de_slots, prep.lease)
            prep.de_slots = []

    def _detach_slots(self, prep: Prepared) -> Callable[[], None]:
        """The request lets go of its slots now; the returned call gives them back."""
        held = [(prep.assign.pe, prep.pe_slots), (prep.assign.de, prep.de_slots)]
        prep.pe_slots, prep.de_slots = [], []

        def give_back() -> None:
            for engine, slots in held:
                if slots:
                    self._give_back(engine, slots, prep.lease)

        return give_back

    def _give_back(self, engine: int, slots: list[int], lease: int) -> None:
        self._release(self.topology.node_of(engine), slots, lease)

    def _release(self, node: int, slots: list[int], lease: int) -> None:
        buf = self.buffers[node]
        if (queue := self._slot_queues.get(node)) is not None:
            queue.kick()
        # never on the event loop: a side-car request, or a buffer lock that another process
        # may hold while it waits for a CPU (the loop would wait with it)
        with contextlib.suppress(RuntimeError):  # (no loop: a plain call, at once)
            asyncio.get_running_loop()
            self._calls.submit(buf.release, slots, lease)
            return
        buf.release(slots, lease)

    def free_slots(self) -> dict[int, tuple[int, int]]:
        """Per node: (free slots, slots) of its buffer."""
        return {n: (b.num_free, b.spec.num_slots) for n, b in sorted(self.buffers.items())}

    def reattach(self, node: int) -> None:
        """Node ``node``'s side-car was restarted: its buffer is a new segment."""
        old = self.buffers.pop(node)
        old.close()
        spec = self.dep.nodes[node]
        self.buffers[node] = (
            RemoteSlots(spec, self._sidecar) if spec.networked else attach_buffer(spec)
        )

    def abort(self, turn: Turn) -> None:
        """The turn failed or its client left: out of every count now, or (queued) at the
        next pull, which the core drops it at."""
        if turn.phase.over:
            return
        if self.core.cancel(turn, self.now()):
            self.core.abort(turn, self.now())
            self.core.forget(turn.request_id)
        self.stats.num_aborted += 1
        self._pull()

    def node_stats(self) -> list[dict[str, Any]]:
        out = []
        for spec in self.dep.nodes:
            try:
                out.append(self._sidecar(spec.control, {"op": "stats"}))
            except (OSError, ValueError):
                out.append({"node": spec.node, "kind": spec.kind, "down": True})
        return out

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()
        self.store.close()
        self._calls.shutdown(wait=False)
        if self._pool is not None:
            self._pool.close()
