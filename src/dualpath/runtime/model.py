"""The runtime's model interface and its KV classes.

Every model an engine runs (``RuntimeModel``: ``hf_model.HFTransformer``, over a Hugging Face
checkpoint's weights or the built-in tiny model's seeded ones, ``tiny.TinyTransformer``) is
executed one layer at a time over a batch of sequences, each sequence's new
tokens after its cached prefix, with the KV kept outside the model (``BatchKV``): an engine's
paged HBM (``hbm.PagedKV``) or a preallocated ``KVCache`` (the recompute reference). That is
what lets engines load each layer's Layer Blocks just before computing it and send its KV right
after (design §8). A layer's KV for T tokens is ``[T, 2, kv_heads, head_dim]`` (K then V per
token): ``kv_row_bytes`` per token, exactly a Layer Block row.
Attention is behind ``attention.AttentionBackend``. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

# on_hidden(layer, h): the layer's output hidden states [Σ new, hidden] (the PEs' exchange)
HiddenHook = Callable[[int, Tensor], None]


class HeadMajorKV(NamedTuple):
    """One layer's KV of a batch as attention takes it: K and V ``[B, kvh, L, hd]`` (views
    may be strided between sequences; rows past a sequence's length are never read)."""

    k: Tensor
    v: Tensor

    def to(self, device: Any, dtype: torch.dtype) -> HeadMajorKV:
        return HeadMajorKV(self.k.to(device, dtype), self.v.to(device, dtype))


class BatchKV(Protocol):
    """Where a batched forward keeps its KV: sequence ``i`` has ``past_lens[i]`` cached tokens
    (the same in every layer) and gets ``lens[i]`` new ones in this forward."""

    @property
    def past_lens(self) -> Sequence[int]: ...

    def update(self, layer: int, new_kv: Tensor, lens: Sequence[int]) -> Tensor | HeadMajorKV:
        """Store ``layer``'s KV of the new tokens (``[Σ lens, 2, kvh, hd]``, sequence-major)
        and return the layer's whole KV, cached then new, padded: ``[B, L, 2, kvh, hd]`` with
        ``L = max(past_lens[i] + lens[i])``, or the same as ``HeadMajorKV`` (a decode batch
        kept in attention's layout, ``decode_kv.DecodeKV``); rows past a sequence's length
        are never read."""
        ...


class RuntimeModel(Protocol):
    """What an engine needs from a model (``TinyTransformer``, ``hf_model.HFTransformer``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_tokens: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype

    @property
    def kv_row_bytes(self) -> int: ...

    def forward_batch(
        self,
        new_tokens: Sequence[Sequence[int]],
        kv: BatchKV,
        on_hidden: HiddenHook | None = None,
    ) -> Tensor:
        """Logits of each sequence's last new token, ``[B, vocab]`` float32 on the CPU."""
        ...


def kv_row_bytes(model: RuntimeModel) -> int:
    """Bytes of one token's KV in one layer (a Layer Block row)."""
    return 2 * model.num_kv_heads * model.head_dim * model.dtype.itemsize


def positions(past_lens: Sequence[int], lens: Sequence[int]) -> Tensor:
    """Absolute position of every new token, sequence-major ``[Σ lens]``."""
    return torch.cat([torch.arange(p, p + t) for p, t in zip(past_lens, lens, strict=True)])


def last_rows(lens: Sequence[int]) -> Tensor:
    """Index of each sequence's last new token in the sequence-major batch."""
    return torch.tensor(list(lens)).cumsum(0) - 1


class KVCache:
    """Preallocated per-layer KV of one sequence, ``[capacity, 2, kv_heads, head_dim]`` each;
    ``length`` tokens are valid. ``CacheBatch`` runs several of them through one forward."""

    def __init__(self, model: RuntimeModel, capacity_tokens: int) -> None:
        shape = (capacity_tokens, 2, model.num_kv_heads, model.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=model.dtype, device=model.device)
            for _ in range(model.num_layers)
        ]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[0] if self.layers else 0

    def past(self, layer: int) -> Tensor:
        return self.layers[layer][: self.length]

    def extend(self, model: RuntimeModel, tokens: Sequence[int]) -> Tensor:
        """Prefill/decode ``tokens`` after the cached ones, append their KV; last logits."""
        return model.forward_batch([tokens], CacheBatch([self]))[0]


class CacheBatch:
    """``BatchKV`` over ``KVCache``s; each cache's ``length`` advances after the last layer."""

    def __init__(self, caches: Sequence[KVCache]) -> None:
        self.caches = list(caches)
        self.past_lens = [c.length for c in self.caches]

    def update(self, layer: int, new_kv: Tensor, lens: Sequence[int]) -> Tensor:
        start = 0
        for c, p, t in zip(self.caches, self.past_lens, lens, strict=True):
            if p + t > c.capacity:
                raise ValueError(f"{p} + {t} tokens exceed the KV cache's capacity {c.capacity}")
            c.layers[layer][p : p + t] = new_kv[start : start + t]
            start += t
        rows = [
            c.layers[layer][: p + t]
            for c, p, t in zip(self.caches, self.past_lens, lens, strict=True)
        ]
        out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        if layer == len(self.caches[0].layers) - 1:
            for c, p, t in zip(self.caches, self.past_lens, lens, strict=True):
                c.length = p + t
        return out


@torch.no_grad()
def greedy_generate(
    model: RuntimeModel, prompt: Sequence[int], num_tokens: int
) -> tuple[list[int], KVCache]:
    """Recompute from scratch: greedy ``num_tokens`` tokens; returns them and the cache
    holding the KV of prompt + generated[:-1] (the reference for tests)."""
    cache = KVCache(model, len(prompt) + num_tokens)
    out = [int(cache.extend(model, prompt).argmax())]
    while len(out) < num_tokens:
        out.append(int(cache.extend(model, out[-1:]).argmax()))
    return out, cache
