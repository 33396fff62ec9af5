"""Attention behind a small backend interface: what the model's forward (``hf_model``) calls
for each layer, given the new tokens' queries and the layer's KV as the ``BatchKV`` returned it.

A backend takes the queries ``q`` ``[Σ lens, H, head_dim]`` of a batch's new tokens and the
layer's whole KV (cached then new) of each sequence, and returns the causal attention output
``[Σ lens, H·head_dim]``; sequence ``i`` has ``past_lens[i]`` cached tokens and ``lens[i]``
new ones. Grouped-query attention: query head ``h`` reads KV head ``h // (H / kv_heads)``.
The KV comes as the padded ``[B, L, 2, kv_heads, head_dim]`` tensor of a prefill batch or as
``HeadMajorKV`` (a decode batch kept in attention's layout, ``decode_kv.DecodeKV``).

``SdpaAttention`` (torch's ``scaled_dot_product_attention``, CPU or CUDA) is the one backend
today; a paged GPU kernel (FlashInfer's, or FlashAttention's varlen over the engine's
``hbm.PagedKV`` pages) would be a second one, chosen by name (``backend``) without changing
the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from dualpath.runtime.model import HeadMajorKV


class AttentionBackend(Protocol):
    name: str

    def attend(
        self, q: Tensor, kv: Tensor | HeadMajorKV, past_lens: Sequence[int], lens: Sequence[int]
    ) -> Tensor:
        """Causal GQA attention of the batch's new queries over each sequence's KV."""
        ...


class SdpaAttention:
    """One ``scaled_dot_product_attention`` call per layer for the whole batch: queries padded
    to the longest sequence's new tokens with a causal mask by absolute position (prefill and
    mixed batches), or one query row per KV head's group without padding (a decode batch in
    ``HeadMajorKV``)."""

    name = "sdpa"

    def attend(
        self, q: Tensor, kv: Tensor | HeadMajorKV, past_lens: Sequence[int], lens: Sequence[int]
    ) -> Tensor:
        return _attend(q, kv, past_lens, lens)


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"sdpa": SdpaAttention}


def backend(name: str = "sdpa") -> AttentionBackend:
    """The attention backend called ``name``; ValueError (one line) for an unknown one."""
    make = BACKENDS.get(name)
    if make is None:
        raise ValueError(
            f"attention backend {name!r} is unknown: must be one of {', '.join(BACKENDS)}"
        )
    return make()


def _attend(
    q: Tensor, kv: Tensor | HeadMajorKV, past_lens: Sequence[int], lens: Sequence[int]
) -> Tensor:
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
            -1, 1, 1, 1
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, kvh, heads // kvh, hd), kv.k, kv.v, attn_mask=mask
    )  # [B, kvh, G, hd]
    return out.reshape(b, heads * hd)
