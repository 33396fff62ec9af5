"""The PE process: batched, chunked, layerwise prefill (design §4, §7.2, §8) over a paged HBM.

Each ``ForwardMsg`` is one forward pass packed by the policy's intra-engine plan: several
requests' chunks, computed together (``RuntimeModel.forward_batch``). A loader thread
allocates each layer's pages for every chunk and pulls the cached prefix's Layer Blocks
(storage hits from the PE or DE buffer, earlier chunks from the DE buffer), keeping up to
``transfer_window`` transfers outstanding and running ahead into the next layers while pages
are free; the layer computes; the PEs of the group exchange the layer's hidden states (HIGH,
in lockstep: ``exchange.HiddenExchange``); a sender thread writes the new KV (and, on the PE
read path's first chunk, the hit KV) into the DE buffer slots as LOW, then frees the layer's
pages. Non-layerwise (Basic): every layer's pages of the whole batch are allocated and loaded
before the pass computes, so HBM caps its batch.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from dualpath.kv.pacer import transfer_all
from dualpath.kv.transport import make_collective_transport
from dualpath.kv.transport.base import KVTransport, Transfer
from dualpath.metrics.hops import hop
from dualpath.runtime.engine import Engine, TransferWindow
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.exchange import HiddenExchange, region_bytes
from dualpath.runtime.gputime import LayerFloor
from dualpath.runtime.hbm import PagedKV
from dualpath.runtime.messages import ChunkWork, ForwardDoneMsg, ForwardMsg
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.token_choice import choose_batch
from dualpath.types import TrafficClass


class PrefillEngine(Engine):
    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        super().__init__(env, engine_id, crash_at)
        self.exchange: HiddenExchange | None = None
        self._exchange_shm: SharedMemory | None = None
        self._collective: KVTransport | None = None
        name = env.exchange_names[engine_id] if env.exchange_names else ""
        group = env.group_members(engine_id)
        memory: memoryview | None = None
        if name:  # the launcher's segment, registered with the collectives' transport
            shm = SharedMemory(name=name)
            assert shm.buf is not None
            self._exchange_shm = shm
            memory = shm.buf
        elif env.own_exchange and len(group) > 1:  # its own region, announced when ready
            name = f"x{engine_id}-{os.getpid()}"
            memory = memoryview(bytearray(region_bytes(len(group))))
        if memory is not None:
            self._collective = make_collective_transport(env.options.transport)
            xport = self._collective or self.transport
            self.ready_region = xport.register(name, memory)
            self.exchange = HiddenExchange(
                engine_id,
                xport,
                self.ready_region,
                memory,
                group,
                self._charge_collective,
                env.options.request_timeout_s,
                lambda: not env.parent_alive(),
            )

    def _charge_collective(self, peer: int, nbytes: int) -> None:
        """HIGH on this CNIC's tx and the peer's rx (collectives are paced in every system)."""
        route = [self.cnic.tx, self.cnic_of(peer).rx]
        transfer_all(route, nbytes, TrafficClass.HIGH)

    def close(self) -> None:
        super().close()
        if self.exchange is not None:
            self.exchange.close()
        if self._collective is not None:
            self._collective.close()
        if self._exchange_shm is not None:
            self._exchange_shm.close()

    def _spans(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """(block index, first row in block, rows) covering tokens ``first..last``."""
        out = []
        t = first
        while t < last:
            b, r = divmod(t, self.block_tokens)
            n = min(self.block_tokens - r, last - t)
            out.append((b, r, n))
            t += n
        return out

    def _pull_cached(
        self, c: ChunkWork, layer: int, table: list[int]
    ) -> list[tuple[int, Transfer]]:
        """Issue every Layer Block of chunk ``c``'s cached prefix for ``layer``: charged once
        per source node (the layer's loads posted together), then copied block by block."""
        moves = []
        per_node: dict[int, int] = {}
        for b in range(self.pool.pages_for(c.cached)):
            rows = min(self.block_tokens, c.cached - b * self.block_tokens)
            hit = b * self.block_tokens < c.hit
            node = c.hit_node if hit else c.de_node
            slot = c.hit_slots[b] if hit else c.de_slots[b]
            moves.append((node, slot, rows, table[b]))
            per_node[node] = per_node.get(node, 0) + rows * self.row_bytes
        for node, nbytes in sorted(per_node.items()):
            self.charge(node, nbytes, to_hbm=True)
        return [self.pull_nowait(n, s, layer, 0, rows, p, False) for n, s, rows, p in moves]

    def handle(self, msg: Any) -> None:
        assert isinstance(msg, ForwardMsg)
        start = self.clock.now()
        hop("pe.pass", msg.chunks[0].request_id)
        layers, chunks, pool = self.model.num_layers, msg.chunks, self.pool
        timeout_s = self.env.options.request_timeout_s
        window_size = self.env.options.transfer_window
        tables: list[list[list[int]]] = [[[] for _ in chunks] for _ in range(layers)]
        loaded = [threading.Event() for _ in range(layers)]
        moved = {"in": 0, "out": 0}
        errors: list[BaseException] = []  # a failed transfer thread fails the pass loudly

        def try_alloc_layer(layer: int) -> bool:
            got: list[list[int]] = []
            for c in chunks:
                pages = pool.alloc(pool.pages_for(c.cached + c.new))
                if pages is None:
                    pool.free([p for g in got for p in g])
                    return False
                got.append(pages)
            tables[layer] = got
            return True

        def alloc_layer(layer: int) -> None:
            for i, c in enumerate(chunks):
                tables[layer][i] = pool.alloc_wait(pool.pages_for(c.cached + c.new), timeout_s)

        def load() -> None:
            window = TransferWindow(window_size)
            in_flight: deque[tuple[int, list[Transfer]]] = deque()

            def complete(block: bool) -> None:
                """Mark loaded the oldest layers whose transfers are all done."""
                while in_flight and (block or all(t.done() for t in in_flight[0][1])):
                    layer, transfers = in_flight.popleft()
                    for t in transfers:
                        t.wait()
                    loaded[layer].set()

            try:
                if not msg.layerwise:  # Basic: the whole batch's KV is resident at once
                    for layer in range(layers):
                        alloc_layer(layer)
                for layer in range(layers):
                    # layerwise: one layer of the batch; issued ahead of the layers still in
                    # flight while pages are free, else after them (their compute frees pages)
                    if msg.layerwise and not try_alloc_layer(layer):
                        complete(block=True)
                        alloc_layer(layer)
                    transfers = []
                    for i, c in enumerate(chunks):
                        for nbytes, done in self._pull_cached(c, layer, tables[layer][i]):
                            moved["in"] += nbytes
                            window.add(done)
                            transfers.append(done)
                            complete(block=False)
                    in_flight.append((layer, transfers))
                    complete(block=False)
                complete(block=True)
            except BaseException as err:
                errors.append(err)
                for event in loaded:
                    event.set()

        sends: queue.Queue[int | None] = queue.Queue()

        def send() -> None:
            try:
                window = TransferWindow(window_size)
                while (layer := sends.get()) is not None:
                    for i, c in enumerate(chunks):
                        table = tables[layer][i]
                        spans = self._spans(c.send_from, c.cached + c.new)
                        sent = sum(n for _, _, n in spans) * self.row_bytes
                        self.charge(c.de_node, sent, to_hbm=False)  # the layer's sends, together
                        for b, r, n in spans:
                            nbytes, done = self.push_nowait(
                                c.de_node, c.de_slots[b], layer, r, n, table[b], False
                            )
                            moved["out"] += nbytes
                            window.add(done)
                    window.drain()  # the layer is in the DE buffer: its pages can go
                    for i in range(len(chunks)):
                        pool.free(tables[layer][i])
                        tables[layer][i] = []
            except BaseException as err:
                errors.append(err)

        loader = threading.Thread(target=load, name="load", daemon=True)
        sender = threading.Thread(target=send, name="send", daemon=True)
        loader.start()
        sender.start()
        plan = msg.exchange
        step = None
        if plan is not None and self.exchange is not None:
            step = self.exchange.run_pass(plan, self.model.hidden_size)

        floor = LayerFloor(self._emulated_s(msg), layers, self.clock.now)

        def wait_loaded(layer: int) -> None:
            t0 = self.clock.now()
            loaded[layer].wait()
            floor.waited(self.clock.now() - t0)
            if errors:
                raise errors[0]

        def on_hidden(layer: int, h: torch.Tensor) -> None:
            floor.layer_done()  # the layer's compute ends no earlier than its emulated time
            if step is not None:  # the collective blocks compute, as on a GPU
                step(layer, h.float().cpu())  # the exchange carries float32 rows
                floor.restart()

        new_tokens = [c.tokens[c.cached : c.cached + c.new] for c in chunks]
        kv = PagedKV(
            pool,
            lambda layer: tables[layer],
            [c.cached for c in chunks],
            before=wait_loaded,
            after=sends.put,
        )
        try:
            logits = self.model.forward_batch(new_tokens, kv, on_hidden)
        finally:
            sends.put(None)
            loader.join()
            sender.join()
        if errors:
            raise errors[0]
        hop("pe.layers_done", msg.chunks[0].request_id)
        last = [i for i, c in enumerate(chunks) if c.is_last]
        picked = choose_batch(
            [self.chooser(chunks[i].sampling) for i in last],
            logits[last] if len(last) < len(chunks) else logits,
            [_generator(chunks[i].sampling) for i in last],
        )
        firsts = tuple((chunks[i].request_id, t) for i, (t, _) in zip(last, picked, strict=True))
        logprobs = tuple(
            (chunks[i].request_id, lp)
            for i, (_, lp) in zip(last, picked, strict=True)
            if lp is not None
        )
        hop("pe.done", msg.chunks[0].request_id)
        self.env.results.put(
            ForwardDoneMsg(
                self.engine_id,
                tuple(c.request_id for c in chunks),
                firsts,
                start,
                self.clock.now(),
                moved["in"],
                moved["out"],
                pool.num_free,
                logprobs,
                floor.emulated_s or 0.0,
                floor.host_s,
            )
        )

    def _emulated_s(self, msg: ForwardMsg) -> float | None:
        """The pass's emulated GPU time (None: host time): this PE's chunks, its group's
        new tokens (the exchange plan's, else its own)."""
        if self.gpu_time is None:
            return None
        own = sum(c.new for c in msg.chunks)
        group = sum(msg.exchange.new_tokens) if msg.exchange is not None else own
        return self.gpu_time.prefill_s([(c.cached, c.new) for c in msg.chunks], group)


def _generator(sampling: SamplingParams | None) -> torch.Generator | None:
    """The generator of a request's first output token (None: greedy)."""
    if sampling is None or sampling.temperature <= 0.0:
        return None
    return sampling.generator(0)
