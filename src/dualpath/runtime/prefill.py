"""The PE process: layerwise prefill (SPEC §4, §8) with per-layer load and send.

For each layer: its Layer Blocks arrive from the PE buffer (PE read path) or the DE buffer
(DE read path) on a loader thread, the layer computes, the layer's model-parallel traffic
goes out as HIGH, and a sender thread writes the layer's KV (all tokens on the PE path, new
tokens on the DE path) into the request's DE buffer slots as LOW. Non-layerwise (Basic):
every layer's KV is loaded before the forward pass starts.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from dualpath.models import cost
from dualpath.runtime.engine import Engine
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.messages import PrefillDoneMsg, PrefillMsg
from dualpath.types import EngineKind, TrafficClass


def collective_bytes_per_layer(env: ProcEnv, num_tokens: int) -> int:
    """HIGH bytes one PE sends per layer: the MoE dispatch+combine share (cost model), or for
    a dense model an all-gather of the layer's float32 hidden states (tokens × hidden × 4),
    standing in for the TP/EP collective a bigger model would run."""
    m = env.config.model
    if m.is_moe:
        topo = env.topology
        ep = topo.group_nodes(EngineKind.PE) * topo.gpus_per_node  # EP size of the group
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
        assert isinstance(msg, PrefillMsg)
        start = self.clock.now()
        layers = self.model.num_layers
        num_tokens = len(msg.tokens)
        loaded = [threading.Event() for _ in range(layers)]
        moved = {"in": 0, "out": 0}
        errors: list[BaseException] = []  # a failed transfer thread fails the request loudly

        def load() -> None:
            try:
                for layer in range(layers):
                    for b, r, n in self._spans(0, msg.cached):
                        slot = msg.src_slots[b]
                        moved["in"] += self.pull(
                            msg.src_node, slot, layer, r, n, b * self.block_tokens + r
                        )
                    loaded[layer].set()
            except BaseException as err:
                errors.append(err)
                for event in loaded:
                    event.set()

        sends: queue.Queue[int | None] = queue.Queue()

        def send() -> None:
            try:
                while (layer := sends.get()) is not None:
                    for b, r, n in self._spans(msg.send_from, num_tokens):
                        at = b * self.block_tokens + r
                        moved["out"] += self.push(msg.de_node, msg.de_slots[b], layer, r, n, at)
            except BaseException as err:
                errors.append(err)

        loader = threading.Thread(target=load, name="load", daemon=True)
        sender = threading.Thread(target=send, name="send", daemon=True)
        loader.start()
        sender.start()
        if not msg.layerwise:  # classic: the whole batch's KV is resident before the forward
            loader.join()
        high = collective_bytes_per_layer(self.env, num_tokens - msg.cached)

        def get_past(layer: int) -> torch.Tensor:
            loaded[layer].wait()
            if errors:
                raise errors[0]
            return self.hbm_layer(layer, msg.cached)

        def on_layer(layer: int, new_kv: torch.Tensor) -> None:
            self.hbm_layer(layer, num_tokens)[msg.cached :] = new_kv
            if high and self.paced:
                self.cnic.tx.transfer(high, TrafficClass.HIGH)  # collectives block compute
            sends.put(layer)

        logits = self.model.prefill(msg.tokens[msg.cached :], get_past, on_layer)
        sends.put(None)
        loader.join()
        sender.join()
        if errors:
            raise errors[0]
        self.env.results.put(
            PrefillDoneMsg(
                msg.request_id,
                self.engine_id,
                int(logits.argmax()),
                start,
                self.clock.now(),
                moved["in"],
                moved["out"],
            )
        )
