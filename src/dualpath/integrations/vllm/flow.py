"""The DualPath router's shared state over vLLM instances: what every request uses.

One ``TurnFlow`` per router: the core (ledger, policy, turn table) that the shell reports
each turn to, the store's index, the node buffers (attached, or a networked node's side-car),
the queues of requests waiting for slots, and the threads that ask side-cars. A request's own
way through it, step by step, is ``request.Request``'s; the flow offers the steps it needs
(look hits up, wait for a prefix's writes, submit a turn and await its place, allocate slots,
count the bytes each path moved) and the one primitive that returns slots to a buffer
(``release_slots``), which only a request's ``Lease`` calls.

Slots are leased, never handed over blindly: a request's PE and DE slots are allocated under
its lease tag (``SlotBuffer`` owner tags); the decode instance claims its DE slots when it
loads them (``plan.StepPlanner``), a prefill instance pins what it loads and saves while it
runs, and the request's one exit (``Request.close``) frees whatever is still under its lease.
A client that leaves before the decode loaded, a decode that never got scheduled, a timeout:
the slots come back either way, and a claim that comes too late finds no lease and recomputes
instead of reading reused slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dualpath.integrations.vllm.lease import Lease
from dualpath.integrations.vllm.node import NodeSpec, RemoteSlots, SidecarPool, attach_buffer
from dualpath.integrations.vllm.setup import Deployment
from dualpath.integrations.vllm.slotqueue import SlotQueue
from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.doorbell import Listener
from dualpath.kv.stores import open_store
from dualpath.ledger import Core, Phase, Topology
from dualpath.ledger.core import Read
from dualpath.ledger.counters import VLLM_PATHS
from dualpath.ledger.turn import Turn
from dualpath.policy import Assign
from dualpath.policy.base import Policy
from dualpath.policy.core import PolicyCore
from dualpath.policy.forced import ForcedSide
from dualpath.types import EngineKind, KVPath, ReadSide

SLOT_DEADLINE_S = 300.0  # and at most this long (the router passes its request timeout)
# A new turn waits at most this long for writes of its prefix still queued at a DE node's
# side-car (a fault, or a SNIC far behind: then it goes with what is durable and recomputes)
SETTLE_WAIT_S = 10.0
# Threads for side-car requests: one per request waiting on a side-car at most (a storage read
# holds one for as long as its SNIC takes); beyond that, requests wait for a thread
SIDECAR_THREADS = 256
# across nodes, a prefill's KV to the decode node: "layerwise", each layer pushed by the PE
# node's side-car as the prefill saved it (arXiv 2602.21548 §4), or "after" the prefill
# answered, every block at once (the hand-over before the layerwise one: for comparisons)
HANDOVER_ENV = "DUALPATH_HANDOVER"
HANDOVERS = ("layerwise", "after")
# a networked node's side-car waits this long for slots to be freed before it says its buffer
# is full (then the node's slot queue asks again): one call per second at most while it is
REMOTE_ALLOC_WAIT_S = 1.0
T = TypeVar("T")


class FlowError(Exception):
    """A request cannot be served: ``status`` and a one-line message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


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
        handover: str | None = None,
    ) -> None:
        """``sidecar``: how side-cars are asked (default: a ``SidecarPool``'s kept
        connections); ``force_side``: every read from that side, whatever the policy chose
        (``ForcedSide``); ``slot_deadline_s``: how long a request waits for buffer slots
        (then a 503 naming the node); ``handover``: across nodes, how a prefill's KV goes
        to the decode node (``HANDOVERS``; None: ``$DUALPATH_HANDOVER``, else layerwise)."""
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
        handover = handover or os.environ.get(HANDOVER_ENV) or "layerwise"
        if handover not in HANDOVERS:
            raise ValueError(
                f"{HANDOVER_ENV}={handover!r} is invalid: must be one of {', '.join(HANDOVERS)}"
            )
        self.layerwise = self.networked and handover == "layerwise"
        self.boot = os.urandom(4).hex()  # names this router's hand-overs (side-cars outlive it)
        self._pool = SidecarPool() if sidecar is None else None
        ask: Callable[[str, dict[str, Any]], dict[str, Any]] = (
            self._pool.call if self._pool is not None else sidecar  # type: ignore[assignment]
        )
        self.buffers: dict[int, SlotBuffer | RemoteSlots] = {
            n.node: RemoteSlots(n, ask) if n.networked else attach_buffer(n) for n in dep.nodes
        }
        self.full_block_bytes = spec0.layout.full_block_bytes
        self.ask_sidecar = ask
        self._ids = itertools.count()
        self._placed: dict[int, asyncio.Future[tuple[Assign, list[Read]]]] = {}
        self._epoch = time.monotonic()
        self.slot_deadline_s = slot_deadline_s
        self._calls = ThreadPoolExecutor(SIDECAR_THREADS, thread_name_prefix="sidecar-call")
        self.stats = FlowStats()
        # per node: the doorbell its slot queue listens to (``_listen``)
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, Listener]] = {}
        self._slot_queues: dict[int, SlotQueue[Lease]] = {}  # per node: requests waiting for slots
        # bytes given to each node's SNIC to write (the write side's balance, ``persist_prompt``)
        self.written: dict[int, float] = {n.node: 0.0 for n in dep.nodes}
        # the side-cars that may hold queued writes: the DE nodes', and across nodes the PE
        # nodes' too (they persist prompts: ``persist_prompt``)
        self._writers = [n for n in dep.nodes if n.kind == EngineKind.DE.value or self.networked]

    def off_loop(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
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

    def next_rid(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------ hits and placement
    def check_fits(self, num_tokens: int) -> None:
        """A prompt that no node buffer can hold is refused at once (it would wait forever)."""
        need = -(-num_tokens // self.dep.block_tokens)
        cap = min(n.num_slots for n in self.dep.nodes)
        if need > cap:
            raise FlowError(
                400,
                f"the prompt has {num_tokens} tokens: a node buffer holds "
                f"{cap * self.dep.block_tokens} (raise --vllm-buffer-mib)",
            )

    async def lookup(self, keys: list[str]) -> int:
        """Leading tokens of ``keys`` the store holds (its index off the event loop: files to
        stat, or a master across the network)."""
        with self.stats.time_stage("lookup"):
            return await self.off_loop(self.store.lookup, keys)

    async def settle(self, keys: list[str]) -> bool:
        """Wait until no DE node's side-car has ``keys`` queued for a write; whether one had
        (then look the hits up again). A side-car that does not answer holds nothing back: its
        node's reads fail on their own."""

        def ask(spec: NodeSpec) -> bool:
            op = {"op": "settle", "keys": keys, "timeout_s": SETTLE_WAIT_S}
            try:
                answer = self.ask_sidecar(spec.control, op)
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
            waited = await asyncio.gather(*(self.off_loop(ask, n) for n in self._writers))
        return any(waited)

    async def submit(self, turn: Turn) -> tuple[Assign, list[Read]]:
        """The turn to the core; its place once a pull gives it one (PE, DE, read side) and
        the storage read the core planned for it. Cancelled (its client left), it stays queued
        until ``Request.close`` takes it out."""
        placed: asyncio.Future[tuple[Assign, list[Read]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._placed[turn.request_id] = placed
        self.core.submit(turn, self.now())
        self.pull()
        return await placed

    def unplace(self, turn: Turn) -> None:
        """The turn no longer waits for its place (its request ended)."""
        self._placed.pop(turn.request_id, None)

    def pull(self) -> None:
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
            waiter = self._placed.pop(turn.request_id, None)
            if waiter is not None and not waiter.done():  # else its client just left
                waiter.set_result((a, reads))

    # ------------------------------------------------------------ slots
    async def alloc(self, node: int, num_slots: int, lease: Lease) -> list[int]:
        """``num_slots`` slots of ``node``'s buffer under ``lease`` (recorded there as they
        are granted), waiting in the node's queue while it is full (at most
        ``slot_deadline_s``: then a 503 naming the buffer)."""
        queue = self._slot_queues.get(node)
        if queue is None:
            queue = self._slot_queues[node] = SlotQueue(functools.partial(self._try_alloc, node))
            self._listen(node, queue)
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

    def _listen(self, node: int, queue: SlotQueue[Lease]) -> None:
        """Wake ``queue`` whenever a process of the node frees slots (its buffer's doorbell,
        ``kv.doorbell``). A networked node's side-car waits for free slots itself; a
        side-car without a doorbell leaves the queue to its backoff."""
        spec = self.dep.nodes[node]
        self._unlisten(node)
        if spec.networked:
            return
        try:
            listener = Listener(spec.doorbell_path)
        except OSError:
            return

        def rung() -> None:
            listener.drain()
            queue.kick()

        loop = asyncio.get_running_loop()
        loop.add_reader(listener.fileno(), rung)
        self._listeners[node] = (loop, listener)

    def _unlisten(self, node: int) -> None:
        if (held := self._listeners.pop(node, None)) is not None:
            loop, listener = held
            if not loop.is_closed():
                loop.remove_reader(listener.fileno())
            listener.close()

    async def alloc_both(
        self, de_node: int, pe_node: int | None, num_slots: int, lease: Lease
    ) -> tuple[list[int], list[int]]:
        """``num_slots`` slots of the DE node's buffer and (``pe_node`` given) of the PE
        node's, asked for together; if either fails, the other's ask ends too (what it got
        is the lease's, which the request gives back)."""
        if pe_node is None:
            return await self.alloc(de_node, num_slots, lease), []
        asks = [
            asyncio.ensure_future(self.alloc(node, num_slots, lease)) for node in (de_node, pe_node)
        ]
        try:
            await asyncio.wait(asks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for ask in asks:
                ask.cancel()
            raise
        failed = next((a for a in asks if a.done() and a.exception() is not None), None)
        if failed is not None:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
            raise failed.exception()  # type: ignore[misc]
        return asks[0].result(), asks[1].result()

    @property
    def slot_waiters(self) -> int:
        """Requests waiting for buffer slots now."""
        return sum(len(q) for q in self._slot_queues.values())

    async def _try_alloc(self, node: int, num_slots: int, lease: Lease) -> list[int] | None:
        """One try, off the event loop (a buffer's lock is shared with other processes; a
        networked node's side-car is asked): the slots (the lease's from now on), None if the
        buffer is full; a side-car that cannot be asked fails the request (503)."""
        buf = self.buffers[node]
        if isinstance(buf, RemoteSlots):  # its side-car waits a while for slots to be freed
            asked = self.off_loop(buf.alloc, num_slots, lease.tag, REMOTE_ALLOC_WAIT_S)
        else:
            asked = self.off_loop(buf.alloc, num_slots, lease.tag)
        try:
            got = await asyncio.shield(asked)
        except (OSError, ValueError) as err:
            raise FlowError(503, f"node {node}'s side-car: {err}") from None
        except asyncio.CancelledError:  # what the thread still allocates is the lease's
            asked.add_done_callback(functools.partial(self._granted_late, node, lease=lease))
            raise
        if got:
            lease.took(node, got)
        return got

    @staticmethod
    def _granted_late(node: int, done: asyncio.Future[Any], *, lease: Lease) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            lease.took(node, done.result())

    def release_slots(self, node: int, slots: list[int], tag: int) -> None:
        """Free those of ``slots`` still under owner ``tag`` in ``node``'s buffer: the only
        way the router returns slots (``Lease.give_back``). Never on the event loop: a
        side-car request, or a buffer lock that another process may hold while it waits for a
        CPU (the loop would wait with it)."""
        buf = self.buffers[node]
        if (queue := self._slot_queues.get(node)) is not None:
            queue.kick()
        with contextlib.suppress(RuntimeError):  # (no loop: a plain call, at once)
            asyncio.get_running_loop()
            self._calls.submit(buf.release, slots, tag)
            return
        buf.release(slots, tag)

    # ------------------------------------------------------------ bytes per path
    @contextlib.contextmanager
    def core_read(self, turn: Turn, node: int, num_blocks: int) -> Iterator[None]:
        """A storage read of the turn's on node ``node`` (the core's read queue of that SNIC
        holds it until it is over)."""
        self.core.read_started(turn, node, num_blocks * self.full_block_bytes, self.now())
        try:
            yield
        finally:
            if turn.phase is Phase.READING:
                self.core.read_done(turn, node, self.now())

    def read_done(self, side: ReadSide, num_blocks: int) -> None:
        """A read brought ``num_blocks`` into the ``side`` node's buffer."""
        path = KVPath.STORAGE_TO_PE_BUFFER if side is ReadSide.PE else KVPath.STORAGE_TO_DE_BUFFER
        self.counters.moved(path, num_blocks * self.full_block_bytes)
        self.stats.reads_by_side[side.value] = self.stats.reads_by_side.get(side.value, 0) + 1

    def prefilled(self, de_path: bool, hit_blocks: int, de_blocks: int) -> None:
        """A prefill answered: its hits came from the DE buffer (``de_path``) or the PE's,
        and its KV went to the DE buffer (the blocks after the hits on the DE path)."""
        nbytes = self.full_block_bytes
        if de_path:
            self.counters.moved(KVPath.DE_BUFFER_TO_PE_HBM, hit_blocks * nbytes)
            saved = de_blocks - hit_blocks
        else:
            self.counters.moved(KVPath.PE_BUFFER_TO_PE_HBM, hit_blocks * nbytes)
            saved = de_blocks
        self.counters.moved(KVPath.PE_HBM_TO_DE_BUFFER, saved * nbytes)

    def free_slots(self) -> dict[int, tuple[int, int]]:
        """Per node: (free slots, slots) of its buffer."""
        return {n: (b.num_free, b.spec.num_slots) for n, b in sorted(self.buffers.items())}

    def reattach(self, node: int) -> None:
        """Node ``node``'s side-car was restarted: its buffer is a new segment, its doorbell
        a new FIFO."""
        old = self.buffers.pop(node)
        old.close()
        spec = self.dep.nodes[node]
        self.buffers[node] = (
            RemoteSlots(spec, self.ask_sidecar) if spec.networked else attach_buffer(spec)
        )
        if (queue := self._slot_queues.get(node)) is not None:
            with contextlib.suppress(RuntimeError):  # (no loop: the queue is idle, unused)
                self._listen(node, queue)

    def node_stats(self) -> list[dict[str, Any]]:
        out = []
        for spec in self.dep.nodes:
            try:
                out.append(self.ask_sidecar(spec.control, {"op": "stats"}))
            except (OSError, ValueError):
                out.append({"node": spec.node, "kind": spec.kind, "down": True})
        return out

    def close(self) -> None:
        for node in list(self._listeners):
            self._unlisten(node)
        for buf in self.buffers.values():
            buf.close()
        self.store.close()
        self._calls.shutdown(wait=False)
        if self._pool is not None:
            self._pool.close()
