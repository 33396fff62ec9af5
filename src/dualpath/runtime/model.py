"""The runtime's model interface, its one KV class, and the built-in tiny transformer.

Every model an engine runs (``RuntimeModel``: the tiny model here, Hugging Face checkpoints in
``hf_model.py``) is executed one layer at a time over a batch of sequences, each sequence's new
tokens after its cached prefix, with the KV kept outside the model (``BatchKV``): an engine's
paged HBM (``hbm.PagedKV``) or a preallocated ``KVCache`` (the recompute reference). That is
what lets engines load each layer's Layer Blocks just before computing it and send its KV right
after (SPEC §8). A layer's KV for T tokens is ``[T, 2, kv_heads, head_dim]`` (K then V per
token): ``kv_row_bytes`` per token, exactly a Layer Block row.
The tiny model's weights come from a seed (``torch.Generator``); nothing is downloaded. No I/O,
no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from dualpath.config import ModelConfig
from dualpath.types import AttentionKind

RMS_EPS = 1e-5
ROPE_THETA = 10000.0

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


def attend(q: Tensor, kv: Tensor | HeadMajorKV, past_lens: Sequence[int],
           lens: Sequence[int]) -> Tensor:  # fmt: skip
    """Causal GQA attention of the new queries ``q`` [Σ lens, H, hd] over each sequence's
    padded KV ``kv`` [B, L, 2, kvh, hd] → ``[Σ lens, H·hd]``. One SDPA call for the batch: a
    query at position p sees keys 0..p of its own sequence; padded query rows are dropped."""
    if isinstance(kv, HeadMajorKV):
        return _attend_decode(q, kv, past_lens)
    b, heads, hd = len(lens), q.shape[1], q.shape[2]
    t_max = max(lens)
    if t_max == 1:  # decode: one query per sequence, no query padding
        qp = q.view(b, 1, heads, hd)
        rows = None
    else:
        rows = torch.cat([torch.arange(t) + i * t_max for i, t in enumerate(lens)])
        qp = q.new_zeros(b * t_max, heads, hd)
        qp[rows] = q
        qp = qp.view(b, t_max, heads, hd)
    qpos = torch.tensor(list(past_lens)).unsqueeze(1) + torch.arange(t_max).unsqueeze(0)
    mask = torch.arange(kv.shape[1]).view(1, 1, -1) <= qpos.unsqueeze(2)  # [B, T, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2),
        kv[:, :, 0].transpose(1, 2),
        kv[:, :, 1].transpose(1, 2),
        attn_mask=mask.unsqueeze(1).to(q.device),
        enable_gqa=True,
    )  # [B, H, T, hd]
    flat = out.transpose(1, 2).reshape(b * t_max, heads * hd)
    return flat if rows is None else flat[rows.to(q.device)]


def _attend_decode(q: Tensor, kv: HeadMajorKV, past_lens: Sequence[int]) -> Tensor:
    """One query per sequence over K / V ``[B, kvh, L, hd]``: the query heads of one KV head
    (head h reads KV head h // G, as SDPA's ``enable_gqa``) are its G query rows, so no KV
    is repeated; a key mask only where the lengths differ."""
    b, heads, hd = q.shape
    kvh = kv.k.shape[1]
    mask = None
    if min(past_lens) != max(past_lens):
        keys = torch.arange(kv.k.shape[2], device=q.device)
        mask = keys.view(1, 1, 1, -1) <= torch.tensor(list(past_lens), device=q.device).view(
            -1, 1, 1, 1)  # fmt: skip
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, kvh, heads // kvh, hd), kv.k, kv.v, attn_mask=mask
    )  # [B, kvh, G, hd]
    return out.reshape(b, heads * hd)


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
        rows = [c.layers[layer][: p + t] for c, p, t in zip(self.caches, self.past_lens, lens,
                                                              strict=True)]  # fmt: skip
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


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    mlp_norm: Tensor
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor


def _rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


class TinyTransformer:
    """Deterministic-weight GQA transformer (RMSNorm, interleaved RoPE, SwiGLU) for a
    ``ModelConfig`` with ``attention="gqa"`` and float32 KV; CPU."""

    def __init__(self, model: ModelConfig, seed: int = 0) -> None:
        if model.attention_kind is not AttentionKind.GQA:
            raise ValueError(
                f"model.attention={model.attention!r} is invalid for the runtime model: must be 'gqa'"
            )
        if model.kv_dtype_bytes != 4:
            raise ValueError(
                f"model.kv_dtype_bytes={model.kv_dtype_bytes} is invalid for the runtime model: "
                "must be 4 (float32 KV)"
            )
        self.config = model
        self.name = f"dualpath-{model.name}"
        self.num_layers = model.num_layers
        self.hidden_size = model.hidden_size
        self.num_heads = model.num_heads
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.vocab_size = model.vocab_size
        self.max_context_tokens = model.max_context_tokens
        self.eos_token_ids: tuple[int, ...] = ()  # the tokenizer's (serve/tokenizer.py)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        gen = torch.Generator().manual_seed(seed)
        hid, ffn = model.hidden_size, model.ffn_hidden_size
        qd, kvd = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim

        def mat(rows: int, cols: int) -> Tensor:
            return torch.randn(rows, cols, generator=gen) / cols**0.5

        def norm() -> Tensor:
            return 1.0 + 0.1 * torch.randn(hid, generator=gen)

        self.embedding = torch.randn(model.vocab_size, hid, generator=gen)
        self.layers = [
            _Layer(
                norm(),
                mat(qd, hid),
                mat(kvd, hid),
                mat(kvd, hid),
                mat(hid, qd),
                norm(),
                mat(ffn, hid),
                mat(ffn, hid),
                mat(hid, ffn),
            )
            for _ in range(model.num_layers)
        ]
        self.final_norm = norm()
        self.lm_head = mat(model.vocab_size, hid)
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(model.max_context_tokens).float(), inv_freq)
        self._cos, self._sin = angles.cos(), angles.sin()

    @property
    def kv_row_bytes(self) -> int:
        return kv_row_bytes(self)

    def tensors(self) -> list[Tensor]:
        """Every weight tensor, in a fixed order (the KV namespace's weight digest)."""
        out = [self.embedding, self.final_norm, self.lm_head]
        for layer in self.layers:
            out.extend(getattr(layer, f) for f in layer.__dataclass_fields__)
        return out

    def _rope(self, x: Tensor, pos: Tensor) -> Tensor:
        # x: [N, heads, head_dim] at absolute positions ``pos`` [N]; rotate pairs (even, odd)
        cos = self._cos[pos].unsqueeze(1)
        sin = self._sin[pos].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _layer(
        self, layer: int, h: Tensor, pos: Tensor, kv: BatchKV, lens: Sequence[int]
    ) -> Tensor:
        w = self.layers[layer]
        n = h.shape[0]
        x = _rms_norm(h, w.attn_norm)
        q = self._rope((x @ w.wq.T).view(n, self.num_heads, self.head_dim), pos)
        k = self._rope((x @ w.wk.T).view(n, self.num_kv_heads, self.head_dim), pos)
        v = (x @ w.wv.T).view(n, self.num_kv_heads, self.head_dim)
        full = kv.update(layer, torch.stack((k, v), dim=1), lens)
        h = h + attend(q, full, kv.past_lens, lens) @ w.wo.T
        x = _rms_norm(h, w.mlp_norm)
        gate = torch.nn.functional.silu(x @ w.w_gate.T)
        return h + (gate * (x @ w.w_up.T)) @ w.w_down.T

    @torch.no_grad()
    def forward_batch(
        self,
        new_tokens: Sequence[Sequence[int]],
        kv: BatchKV,
        on_hidden: HiddenHook | None = None,
    ) -> Tensor:
        """Batched layerwise forward of several sequences (prefill chunks or decode steps):
        projections and MLPs over every new token at once, attention in one padded call;
        returns the logits of each sequence's last new token, ``[B, vocab]``."""
        lens = [len(t) for t in new_tokens]
        if not lens or min(lens) < 1:
            raise ValueError(f"forward_batch needs >= 1 new token per sequence (got {lens})")
        pos = positions(kv.past_lens, lens)
        h = self.embedding[torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long)]
        for layer in range(self.num_layers):
            h = self._layer(layer, h, pos, kv, lens)
            if on_hidden is not None:
                on_hidden(layer, h)
        return _rms_norm(h[last_rows(lens)], self.final_norm) @ self.lm_head.T
