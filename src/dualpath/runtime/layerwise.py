"""One forward pass of a PE, in the named steps of layerwise prefill (arXiv 2602.21548 §4,
§7.2, §8): ``load`` (a loader thread) allocates each layer's pages for every chunk and pulls
the cached prefix's Layer Blocks, keeping up to ``transfer_window`` transfers outstanding and
running ahead into the next layers while pages are free; ``wait_loaded``: a layer computes
once its loads are in; ``on_hidden``: the PEs of the group exchange the layer's hidden states
(HIGH, in lockstep); ``send`` (a sender thread) writes the layer's new KV (and, on the PE read
path's first chunk, the hit KV) into the DE buffer slots as LOW, then frees its pages.
Non-layerwise (Basic): ``load`` allocates every layer's pages of the whole batch before the
first loads, so HBM caps the batch.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

import torch

from dualpath.kv.transport.base import Transfer
from dualpath.runtime.engine import Engine, TransferWindow
from dualpath.runtime.gputime import LayerFloor
from dualpath.runtime.hbm import PagedKV
from dualpath.runtime.messages import ChunkWork, ForwardMsg

ExchangeStep = Callable[[int, torch.Tensor], object]  # (layer, float32 hidden rows)


class LayerwisePass:
    """``msg``'s pass on ``engine``: ``start`` the loader and the sender, then ``compute``.
    A failed transfer thread fails the pass loudly (its error is raised by ``compute``)."""

    def __init__(self, engine: Engine, msg: ForwardMsg) -> None:
        self.engine, self.msg, self.chunks = engine, msg, msg.chunks
        self.num_layers = engine.model.num_layers
        self.timeout_s = engine.env.options.request_timeout_s
        self.window_size = engine.env.options.transfer_window
        # per layer, per chunk: its HBM pages (emptied once the layer is in the DE buffer)
        self.tables: list[list[list[int]]] = [
            [[] for _ in self.chunks] for _ in range(self.num_layers)
        ]
        self.loaded = [threading.Event() for _ in range(self.num_layers)]
        self.moved_in = 0  # bytes pulled into HBM (the loader's)
        self.moved_out = 0  # bytes pushed to the DE buffer (the sender's)
        self.errors: list[BaseException] = []
        self._sends: queue.Queue[int | None] = queue.Queue()
        self._floor: LayerFloor | None = None
        self._step: ExchangeStep | None = None
        self._threads = [
            threading.Thread(target=self.load, name="load", daemon=True),
            threading.Thread(target=self.send, name="send", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def compute(self, floor: LayerFloor, step: ExchangeStep | None) -> torch.Tensor:
        """The batch's forward, layer by layer as each is loaded; the logits of every chunk's
        last token. ``floor``: the pass's emulated GPU time; ``step``: the group's exchange."""
        self._floor, self._step = floor, step
        chunks = self.chunks
        kv = PagedKV(
            self.engine.pool,
            lambda layer: self.tables[layer],
            [c.cached for c in chunks],
            before=self.wait_loaded,
            after=self._sends.put,
        )
        new_tokens = [c.tokens[c.cached : c.cached + c.new] for c in chunks]
        try:
            logits = self.engine.model.forward_batch(new_tokens, kv, self.on_hidden)
        finally:
            self._sends.put(None)
            for t in self._threads:
                t.join()
        if self.errors:
            raise self.errors[0]
        return logits

    # ------------------------------------------------------------------ the steps
    def load(self) -> None:
        """The loader thread: every layer's pages and cached prefix, in layer order."""
        window = TransferWindow(self.window_size)
        in_flight: deque[tuple[int, list[Transfer]]] = deque()
        layerwise = self.msg.layerwise
        try:
            if not layerwise:  # Basic: the whole batch's KV is resident at once
                for layer in range(self.num_layers):
                    self._alloc_layer(layer)
            for layer in range(self.num_layers):
                # layerwise: one layer of the batch; issued ahead of the layers still in
                # flight while pages are free, else after them (their compute frees pages)
                if layerwise and not self._try_alloc_layer(layer):
                    self._complete(in_flight, block=True)
                    self._alloc_layer(layer)
                transfers = []
                for i, c in enumerate(self.chunks):
                    for nbytes, done in self._pull_cached(c, layer, self.tables[layer][i]):
                        self.moved_in += nbytes
                        window.add(done)
                        transfers.append(done)
                        self._complete(in_flight, block=False)
                in_flight.append((layer, transfers))
                self._complete(in_flight, block=False)
            self._complete(in_flight, block=True)
        except BaseException as err:
            self.errors.append(err)
            for event in self.loaded:
                event.set()

    def wait_loaded(self, layer: int) -> None:
        """Before ``layer`` computes: its loads are in (the wait is not GPU time)."""
        assert self._floor is not None
        t0 = self.engine.clock.now()
        self.loaded[layer].wait()
        self._floor.waited(self.engine.clock.now() - t0)
        if self.errors:
            raise self.errors[0]

    def on_hidden(self, layer: int, h: torch.Tensor) -> None:
        """After ``layer`` computed: no earlier than its emulated time, then the exchange."""
        assert self._floor is not None
        self._floor.layer_done()
        if self._step is not None:  # the collective blocks compute, as on a GPU
            self._step(layer, h.float().cpu())  # the exchange carries float32 rows
            self._floor.restart()

    def send(self) -> None:
        """The sender thread: each computed layer's KV to the DE buffer, then its pages go."""
        engine, pool = self.engine, self.engine.pool
        try:
            window = TransferWindow(self.window_size)
            while (layer := self._sends.get()) is not None:
                for i, c in enumerate(self.chunks):
                    table = self.tables[layer][i]
                    spans = self._spans(c.send_from, c.cached + c.new)
                    sent = sum(n for _, _, n in spans) * engine.row_bytes
                    engine.charge(c.de_node, sent, to_hbm=False)  # the layer's sends, together
                    for b, r, n in spans:
                        nbytes, done = engine.push_nowait(
                            c.de_node, c.de_slots[b], layer, r, n, table[b], False
                        )
                        self.moved_out += nbytes
                        window.add(done)
                window.drain()  # the layer is in the DE buffer: its pages can go
                for i in range(len(self.chunks)):
                    pool.free(self.tables[layer][i])
                    self.tables[layer][i] = []
        except BaseException as err:
            self.errors.append(err)

    # ------------------------------------------------------------------ helpers
    def _try_alloc_layer(self, layer: int) -> bool:
        pool, got = self.engine.pool, list[list[int]]()
        for c in self.chunks:
            pages = pool.alloc(pool.pages_for(c.cached + c.new))
            if pages is None:
                pool.free([p for g in got for p in g])
                return False
            got.append(pages)
        self.tables[layer] = got
        return True

    def _alloc_layer(self, layer: int) -> None:
        pool = self.engine.pool
        for i, c in enumerate(self.chunks):
            self.tables[layer][i] = pool.alloc_wait(
                pool.pages_for(c.cached + c.new), self.timeout_s
            )

    def _complete(self, in_flight: deque[tuple[int, list[Transfer]]], block: bool) -> None:
        """Mark loaded the oldest layers whose transfers are all done (``block``: all)."""
        while in_flight and (block or all(t.done() for t in in_flight[0][1])):
            layer, transfers = in_flight.popleft()
            for t in transfers:
                t.wait()
            self.loaded[layer].set()

    def _pull_cached(
        self, c: ChunkWork, layer: int, table: list[int]
    ) -> list[tuple[int, Transfer]]:
        """Issue every Layer Block of chunk ``c``'s cached prefix for ``layer``: charged once
        per source node (the layer's loads posted together), then copied block by block."""
        engine, block = self.engine, self.engine.block_tokens
        moves = []
        per_node: dict[int, int] = {}
        for b in range(engine.pool.pages_for(c.cached)):
            rows = min(block, c.cached - b * block)
            hit = b * block < c.hit
            node = c.hit_node if hit else c.de_node
            slot = c.hit_slots[b] if hit else c.de_slots[b]
            moves.append((node, slot, rows, table[b]))
            per_node[node] = per_node.get(node, 0) + rows * engine.row_bytes
        for node, nbytes in sorted(per_node.items()):
            engine.charge(node, nbytes, to_hbm=True)
        return [engine.pull_nowait(n, s, layer, 0, rows, p, False) for n, s, rows, p in moves]

    def _spans(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """(block index, first row in block, rows) covering tokens ``first..last``."""
        out, t, block = [], first, self.engine.block_tokens
        while t < last:
            b, r = divmod(t, block)
            n = min(block - r, last - t)
            out.append((b, r, n))
            t += n
        return out
