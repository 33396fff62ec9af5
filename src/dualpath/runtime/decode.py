"""The DE process: load the prompt KV from the DE buffer into HBM, decode, persist blocks.

The scheduler frees the request's DE buffer slots once the DE reports them loaded
(``LoadedMsg``), so a DE that dies never double-frees. Every block that fills is copied into
a fresh slot of this node's buffer (waiting for space: backpressure) and handed to the
node's storage worker (SPEC §4: the DE persists the turn's new blocks).
"""

from __future__ import annotations

from typing import Any

from dualpath.runtime.buffer import SlotBuffer
from dualpath.runtime.engine import Engine
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.kvstore import block_keys
from dualpath.runtime.messages import DecodeDoneMsg, DecodeMsg, LoadedMsg, PersistMsg
from dualpath.runtime.model import KVCache


class DecodeEngine(Engine):
    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        super().__init__(env, engine_id, crash_at)
        self.buffer: SlotBuffer = env.attach_buffer(self.node)
        self.storage = env.storage_inboxes[self.node]

    def close(self) -> None:
        super().close()
        self.buffer.close()

    def _persist(self, tokens: list[int], block: int) -> str:
        key = block_keys(
            tokens[: (block + 1) * self.block_tokens], self.block_tokens, self.env.namespace
        )[block]
        slot = self.buffer.alloc_wait(1, timeout_s=self.env.options.request_timeout_s)[0]
        for layer in range(self.model.num_layers):
            self.push(self.node, slot, layer, 0, self.block_tokens, block * self.block_tokens)
        self.storage.put(PersistMsg(key, slot))
        return key

    def handle(self, msg: Any) -> None:
        assert isinstance(msg, DecodeMsg)
        num_prompt = len(msg.tokens)
        bytes_in = 0
        for b, slot in enumerate(msg.de_slots):
            n = min(self.block_tokens, num_prompt - b * self.block_tokens)
            for layer in range(self.model.num_layers):
                bytes_in += self.pull(self.node, slot, layer, 0, n, b * self.block_tokens)
        self.env.results.put(LoadedMsg(msg.request_id))
        cache = KVCache.over(
            [self.hbm_layer(lyr, self.capacity_tokens) for lyr in range(self.model.num_layers)],
            num_prompt,
        )
        tokens = list(msg.tokens)
        persisted: list[str] = []
        for b in range(msg.stored_blocks, num_prompt // self.block_tokens):
            persisted.append(self._persist(tokens, b))
        out = [msg.first_token]
        second_s = self.clock.now()
        while len(out) < msg.output_tokens:
            tokens.append(out[-1])
            out.append(int(cache.extend(self.model, out[-1:]).argmax()))
            if len(out) == 2:
                second_s = self.clock.now()
            if cache.length % self.block_tokens == 0:
                persisted.append(self._persist(tokens, cache.length // self.block_tokens - 1))
        self.env.results.put(
            DecodeDoneMsg(
                msg.request_id,
                self.engine_id,
                tuple(out),
                second_s,
                self.clock.now(),
                bytes_in,
                tuple(persisted),
            )
        )
