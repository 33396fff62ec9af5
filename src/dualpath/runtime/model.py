"""The runtime's real model: a small decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU).

Executed one layer at a time with an explicit per-layer KV cache, so engines can load each
layer's Layer Blocks just before computing it and send its KV right after (SPEC §8). A layer's
KV for T tokens is one float32 tensor ``[T, 2, kv_heads, head_dim]`` (K then V per token), i.e.
``kv_bytes_per_token_per_layer`` bytes per token: exactly a Layer Block row.
Weights come from a seed (``torch.Generator``); nothing is downloaded. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dualpath.config import ModelConfig
from dualpath.types import AttentionKind

RMS_EPS = 1e-5
ROPE_THETA = 10000.0

# get_past(layer) -> KV of the cached prefix for that layer, shape [cached, 2, kv_heads, head_dim]
PastFn = Callable[[int], Tensor]
# on_layer(layer, new_kv) after the layer is computed; new_kv is the KV of the new tokens only
LayerHook = Callable[[int, Tensor], None]
# batched: get_pasts(layer) -> one cached-prefix KV per sequence; on_layers(layer, new KVs)
PastsFn = Callable[[int], Sequence[Tensor]]
LayersHook = Callable[[int, Sequence[Tensor]], None]


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


def run_layers(model: Any, h: Tensor, get_past: PastFn, on_layer: LayerHook | None) -> Tensor:
    """The layerwise loop every runtime model shares: for each layer, its cached prefix KV from
    ``get_past``, the layer, then ``on_layer`` with the new tokens' KV; the last hidden states."""
    for layer in range(model.num_layers):
        h, new_kv = model.layer_forward(layer, h, get_past(layer))
        if on_layer is not None:
            on_layer(layer, new_kv)
    return h


def _rms_norm(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


class TinyTransformer:
    """Deterministic-weight GQA transformer for a ``ModelConfig`` with ``attention="gqa"``."""

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
        self.num_layers = model.num_layers
        self.num_heads = model.num_heads
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
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
        """Bytes of one token's KV in one layer (a Layer Block row)."""
        return 2 * self.num_kv_heads * self.head_dim * 4

    def empty_kv(self, num_tokens: int = 0) -> Tensor:
        return torch.zeros(num_tokens, 2, self.num_kv_heads, self.head_dim)

    def _rope(self, x: Tensor, start: int) -> Tensor:
        # x: [T, heads, head_dim]; rotate pairs (even, odd) by position-dependent angles
        t = x.shape[0]
        cos = self._cos[start : start + t].unsqueeze(1)
        sin = self._sin[start : start + t].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def layer_forward(self, layer: int, h: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        """One layer over new hidden states ``h`` [T, hidden] after ``past`` [P, 2, kvh, hd].

        Returns (new hidden states, KV of the new tokens [T, 2, kvh, hd])."""
        w = self.layers[layer]
        t, p = h.shape[0], past.shape[0]
        x = _rms_norm(h, w.attn_norm)
        q = self._rope((x @ w.wq.T).view(t, self.num_heads, self.head_dim), p)
        k = self._rope((x @ w.wk.T).view(t, self.num_kv_heads, self.head_dim), p)
        v = (x @ w.wv.T).view(t, self.num_kv_heads, self.head_dim)
        new_kv = torch.stack((k, v), dim=1)
        kv = torch.cat((past, new_kv), dim=0) if p else new_kv
        rep = self.num_heads // self.num_kv_heads
        keys = kv[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, P+T, hd]
        vals = kv[:, 1].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = torch.arange(p + t).unsqueeze(0) <= (torch.arange(t) + p).unsqueeze(1)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys, vals, attn_mask=mask
        )
        h = h + attn.transpose(0, 1).reshape(t, -1) @ w.wo.T
        x = _rms_norm(h, w.mlp_norm)
        gate = torch.nn.functional.silu(x @ w.w_gate.T)
        h = h + (gate * (x @ w.w_up.T)) @ w.w_down.T
        return h, new_kv

    def _rope_at(self, x: Tensor, pos: Tensor) -> Tensor:
        # x: [N, heads, head_dim] at absolute positions ``pos`` [N]
        cos = self._cos[pos].unsqueeze(1)
        sin = self._sin[pos].unsqueeze(1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def layer_forward_batch(
        self, layer: int, h: Tensor, lens: Sequence[int], pasts: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """One layer over a batch of sequences: ``h`` [Σ lens, hidden] is the new tokens of
        every sequence concatenated, sequence i after its cached prefix ``pasts[i]``.

        Projections and the MLP run over all tokens at once; attention is one padded
        variable-length SDPA call over the (cached, new) pairs with a per-sequence causal
        mask. Returns (new hidden states, the KV of each sequence's new tokens)."""
        w = self.layers[layer]
        n, b = h.shape[0], len(lens)
        starts = [p.shape[0] for p in pasts]
        pos = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, lens, strict=True)])
        x = _rms_norm(h, w.attn_norm)
        q = self._rope_at((x @ w.wq.T).view(n, self.num_heads, self.head_dim), pos)
        k = self._rope_at((x @ w.wk.T).view(n, self.num_kv_heads, self.head_dim), pos)
        v = (x @ w.wv.T).view(n, self.num_kv_heads, self.head_dim)
        kv_new = torch.stack((k, v), dim=1)
        news = list(kv_new.split(list(lens)))
        t_max = max(lens)
        l_max = max(s + t for s, t in zip(starts, lens, strict=True))
        rep = self.num_heads // self.num_kv_heads
        qp = h.new_zeros(b, t_max, self.num_heads, self.head_dim)
        kvp = h.new_zeros(b, l_max, 2, self.num_kv_heads, self.head_dim)
        qs = q.split(list(lens))
        for i in range(b):
            s, t = starts[i], lens[i]
            qp[i, :t] = qs[i]
            if s:
                kvp[i, :s] = pasts[i]
            kvp[i, s : s + t] = news[i]
        keys = kvp[:, :, 0].repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, H, L, hd]
        vals = kvp[:, :, 1].repeat_interleave(rep, dim=2).transpose(1, 2)
        qpos = torch.tensor(starts).unsqueeze(1) + torch.arange(t_max).unsqueeze(0)  # [B, T]
        mask = torch.arange(l_max).view(1, 1, -1) <= qpos.unsqueeze(2)  # causal, [B, T, L]
        attn = torch.nn.functional.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, vals, attn_mask=mask.unsqueeze(1)
        )  # [B, H, T, hd]; padded query rows see a valid prefix, their output is dropped
        out = attn.transpose(1, 2)
        flat = torch.cat([out[i, : lens[i]] for i in range(b)]).reshape(n, -1)
        h = h + flat @ w.wo.T
        x = _rms_norm(h, w.mlp_norm)
        gate = torch.nn.functional.silu(x @ w.w_gate.T)
        h = h + (gate * (x @ w.w_up.T)) @ w.w_down.T
        return h, news

    @torch.no_grad()
    def forward_batch(
        self,
        new_tokens: Sequence[Sequence[int]],
        get_pasts: PastsFn,
        on_layers: LayersHook | None = None,
        on_hidden: Callable[[int, Tensor], None] | None = None,
    ) -> Tensor:
        """Batched layerwise forward of several sequences (prefill chunks or decode steps);
        returns the logits of each sequence's last new token, ``[B, vocab]``.

        ``get_pasts(layer)`` gives each sequence's cached KV (its length must not change
        across layers); ``on_layers(layer, new_kvs)`` receives each sequence's new KV;
        ``on_hidden(layer, h)`` the layer's output hidden states ``[Σ new, hidden]``."""
        lens = [len(t) for t in new_tokens]
        if not lens or min(lens) < 1:
            raise ValueError(f"forward_batch needs >= 1 new token per sequence (got {lens})")
        ids = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long)
        h = self.embedding[ids]
        for layer in range(self.num_layers):
            h, news = self.layer_forward_batch(layer, h, lens, get_pasts(layer))
            if on_layers is not None:
                on_layers(layer, news)
            if on_hidden is not None:
                on_hidden(layer, h)
        last = torch.tensor(lens).cumsum(0) - 1
        return self.logits(h[last])

    def logits(self, h_last: Tensor) -> Tensor:
        return _rms_norm(h_last, self.final_norm) @ self.lm_head.T

    @torch.no_grad()
    def prefill(
        self,
        new_tokens: Sequence[int],
        get_past: PastFn,
        on_layer: LayerHook | None = None,
    ) -> Tensor:
        """Layerwise prefill of ``new_tokens`` after a cached prefix; returns the last logits.

        For each layer: ``get_past(layer)`` supplies the cached prefix KV (all layers must give
        the same length), the layer runs, then ``on_layer(layer, new_kv)`` receives its KV."""
        if not new_tokens:
            raise ValueError("prefill needs at least one new token (got 0)")
        h = self.embedding[torch.tensor(list(new_tokens), dtype=torch.long)]
        return self.logits(run_layers(self, h, get_past, on_layer)[-1])

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], num_tokens: int) -> tuple[list[int], KVCache]:
        """Recompute from scratch: greedy ``num_tokens`` tokens; returns them and the cache
        holding the KV of prompt + generated[:-1] (the reference for tests)."""
        cache = KVCache(self, len(prompt) + num_tokens)
        out = [int(cache.extend(self, prompt).argmax())]
        while len(out) < num_tokens:
            out.append(int(cache.extend(self, out[-1:]).argmax()))
        return out, cache


class KVCache:
    """Preallocated per-layer KV of one request: ``[capacity, 2, kv_heads, head_dim]`` each."""

    def __init__(self, model: TinyTransformer, capacity_tokens: int) -> None:
        self.layers = [model.empty_kv(capacity_tokens) for _ in range(model.num_layers)]
        self.length = 0

    @classmethod
    def over(cls, layers: list[Tensor], length: int) -> KVCache:
        """A cache over existing per-layer tensors (e.g. views of an engine's HBM region)."""
        cache = cls.__new__(cls)
        cache.layers = layers
        cache.length = length
        return cache

    def past(self, layer: int) -> Tensor:
        return self.layers[layer][: self.length]

    def put(self, layer: int, start: int, kv: Tensor) -> None:
        self.layers[layer][start : start + kv.shape[0]] = kv

    def extend(self, model: TinyTransformer, tokens: Sequence[int]) -> Tensor:
        """Prefill/decode ``tokens`` after the cached ones; append their KV; last logits."""
        start = self.length
        logits = model.prefill(tokens, self.past, lambda layer, kv: self.put(layer, start, kv))
        self.length = start + len(tokens)
        return logits
