"""In-process prefix cache for the local backend: Full Blocks of KV keyed by the content hash
chain (``block_keys``, the KV store's keys), LRU-evicted. Pure bookkeeping over tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from dualpath.runtime.hf_model import SequenceKV
from dualpath.runtime.kvstore import block_keys


class PrefixCache:
    """Up to ``capacity_blocks`` blocks of ``block_tokens`` tokens, each ``[layers, block, 2,
    kv_heads, head_dim]``. A lookup counts the leading run of cached blocks."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} is invalid: must be >= 1")
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks={capacity_blocks} is invalid: must be >= 0")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[str, Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, tokens: Sequence[int], namespace: str) -> list[str]:
        return block_keys(tokens, self.block_tokens, namespace)

    def load(self, tokens: Sequence[int], namespace: str, seq: SequenceKV) -> int:
        """Copy the cached prefix of ``tokens`` into ``seq`` (at least one token is left to
        compute); returns the number of cached tokens."""
        usable = (len(tokens) - 1) // self.block_tokens
        hits: list[Tensor] = []
        for key in self.keys(tokens, namespace)[:usable]:
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            hits.append(block)
        if not hits:
            return 0
        stacked = torch.cat(hits, dim=1)  # [layers, cached, 2, kvh, hd]
        for layer in range(len(seq.layers)):
            seq.put(layer, 0, stacked[layer])
        seq.length = stacked.shape[1]
        return int(seq.length)

    def store(self, tokens: Sequence[int], namespace: str, seq: SequenceKV) -> int:
        """Keep the Full Blocks of ``tokens`` whose KV ``seq`` holds; returns blocks added."""
        added = 0
        b = self.block_tokens
        for i, key in enumerate(self.keys(tokens[: seq.length], namespace)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = torch.stack(
                [layer[i * b : (i + 1) * b].clone() for layer in seq.layers]
            )
            added += 1
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return added
