"""The PE process: batched, chunked, layerwise prefill (SPEC §4, §7.2, §8) over a paged HBM.

Each ``ForwardMsg`` is one forward pass packed by the policy's intra-engine plan: several
requests' chunks, computed together (``TinyTransformer.forward_batch``). For each layer a
loader thread allocates the layer's pages for every chunk and pulls the cached prefix's Layer
Blocks (storage hits from the PE or DE buffer, earlier chunks from the DE buffer); the layer
computes; its model-parallel traffic goes out as HIGH; a sender thread writes the new KV (and,
on the PE read path's first chunk, the hit KV) into the DE buffer slots as LOW, then frees the
layer's pages. Non-layerwise (Basic): every layer's pages of the whole batch are allocated and
loaded before the pass computes, so HBM caps its batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from dualpath.models import cost
from dualpath.runtime.engine import Engine
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.messages import ForwardDoneMsg, ForwardMsg
from dualpath.types import TrafficClass


def collective_bytes_per_layer(env: ProcEnv, num_tokens: int) -> int:
    """HIGH bytes one PE sends per layer: the MoE dispatch+combine share (cost model), or for
    a dense model an all-gather of the layer's float32 hidden states (tokens × hidden × 4),
    standing in for the TP/EP collective a bigger model would run."""
    m = env.config.model
    if m.is_moe:
        topo = env.topology
        ep = topo.prefill_group_gpus  # EP size of the group
        moe = cost.moe_collective_bytes(m, num_tokens, ep, env.topology.gpus_per_node)
        return int(moe / max(1, m.num_layers - m.num_dense_layers))
    return num_tokens * m.hidden_size * 4


class PrefillEngine(Engine):
    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        super().__init__(env, engine_id, crash_at)

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

    def handle(self, msg: Any) -> None:
        assert isinstance(msg, ForwardMsg)
        start = self.clock.now()
        layers, chunks, pool = self.model.num_layers, msg.chunks, self.pool
        timeout_s = self.env.options.request_timeout_s
        tables: list[list[list[int]]] = [[[] for _ in chunks] for _ in range(layers)]
        loaded = [threading.Event() for _ in range(layers)]
        moved = {"in": 0, "out": 0}
        errors: list[BaseException] = []  # a failed transfer thread fails the pass loudly

        def alloc_layer(layer: int) -> None:
            for i, c in enumerate(chunks):
                tables[layer][i] = pool.alloc_wait(pool.pages_for(c.cached + c.new), timeout_s)

        def load() -> None:
            try:
                if not msg.layerwise:  # Basic: the whole batch's KV is resident at once
                    for layer in range(layers):
                        alloc_layer(layer)
                for layer in range(layers):
                    if msg.layerwise:  # one layer of the batch (waits for sent layers' pages)
                        alloc_layer(layer)
                    window = []  # the layer's Layer Blocks are all in flight at once
                    for i, c in enumerate(chunks):
                        for b in range(pool.pages_for(c.cached)):
                            rows = min(self.block_tokens, c.cached - b * self.block_tokens)
                            hit = b * self.block_tokens < c.hit
                            node = c.hit_node if hit else c.de_node
                            slot = c.hit_slots[b] if hit else c.de_slots[b]
                            page = tables[layer][i][b]
                            nbytes, done = self.pull_nowait(node, slot, layer, 0, rows, page)
                            moved["in"] += nbytes
                            window.append(done)
                    for done in window:
                        done.wait()
                    loaded[layer].set()
            except BaseException as err:
                errors.append(err)
                for event in loaded:
                    event.set()

        sends: queue.Queue[int | None] = queue.Queue()

        def send() -> None:
            try:
                while (layer := sends.get()) is not None:
                    window = []  # the layer's sends are all in flight at once
                    for i, c in enumerate(chunks):
                        table = tables[layer][i]
                        for b, r, n in self._spans(c.send_from, c.cached + c.new):
                            slot = c.de_slots[b]
                            nbytes, done = self.push_nowait(c.de_node, slot, layer, r, n, table[b])
                            moved["out"] += nbytes
                            window.append(done)
                    for done in window:
                        done.wait()
                    for i in range(len(chunks)):
                        pool.free(tables[layer][i])
                        tables[layer][i] = []
            except BaseException as err:
                errors.append(err)

        loader = threading.Thread(target=load, name="load", daemon=True)
        sender = threading.Thread(target=send, name="send", daemon=True)
        loader.start()
        sender.start()
        high = collective_bytes_per_layer(self.env, sum(c.new for c in chunks))

        def get_pasts(layer: int) -> list[torch.Tensor]:
            loaded[layer].wait()
            if errors:
                raise errors[0]
            return [pool.gather(tables[layer][i], c.cached) for i, c in enumerate(chunks)]

        def on_layers(layer: int, news: Sequence[torch.Tensor]) -> None:
            for i, c in enumerate(chunks):
                pool.scatter(tables[layer][i], c.cached, news[i])
            if high and self.paced:
                self.cnic.tx.transfer(high, TrafficClass.HIGH)  # collectives block compute
            sends.put(layer)

        new_tokens = [c.tokens[c.cached : c.cached + c.new] for c in chunks]
        try:
            logits = self.model.forward_batch(new_tokens, get_pasts, on_layers)
        finally:
            sends.put(None)
            loader.join()
            sender.join()
        if errors:
            raise errors[0]
        firsts = tuple(
            (c.request_id, int(logits[i].argmax())) for i, c in enumerate(chunks) if c.is_last
        )
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
            )
        )
