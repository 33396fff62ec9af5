"""The built-in tiny model: a Llama (``hf_model.HFTransformer``, the one forward) whose weights
come from a seed (``torch.Generator``), for a ``ModelConfig`` with GQA attention and float32
KV; CPU. Nothing is downloaded.

The weights are drawn in a fixed order (embedding; per layer: attention norm, q, k, v, o,
MLP norm, gate, up, down; final norm; LM head), matrices scaled by 1/sqrt(fan-in), norms
around 1. The model was first written with interleaved RoPE (pairs 2i, 2i+1); HF's Llama
rotates halves (i, i + d/2). Permuting the rows of each head of q and k by ``HALF_ORDER``
turns one into the other (``convert_llama_weights_to_hf`` does the same), so the seeds give
the same model as before: attention scores are sums over the same pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dualpath.config import ModelConfig
from dualpath.runtime.hf_model import HFSpec, HFTransformer
from dualpath.types import AttentionKind

RMS_EPS = 1e-5
ROPE_THETA = 10000.0


def half_order(head_dim: int) -> Tensor:
    """Rows of a head in HF's layout from the interleaved one: evens, then odds."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def tiny_spec(model: ModelConfig) -> HFSpec:
    """The Llama ``config.json`` fields of ``model`` (what the forward reads)."""
    if model.attention_kind is not AttentionKind.GQA:
        raise ValueError(
            f"model.attention={model.attention!r} is invalid for the runtime model: must be 'gqa'"
        )
    if model.kv_dtype_bytes != 4:
        raise ValueError(
            f"model.kv_dtype_bytes={model.kv_dtype_bytes} is invalid for the runtime model: "
            "must be 4 (float32 KV)"
        )
    return HFSpec(
        model_type="llama",
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=model.max_context_tokens,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    )


def tiny_weights(model: ModelConfig, seed: int) -> dict[str, Tensor]:
    """The seeded weights under the names ``LlamaForCausalLM`` saves them by."""
    gen = torch.Generator().manual_seed(seed)
    hid, ffn, hd = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qd, kvd = model.num_heads * hd, model.num_kv_heads * hd
    order = half_order(hd)

    def mat(rows: int, cols: int) -> Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm() -> Tensor:
        return 1.0 + 0.1 * torch.randn(hid, generator=gen)

    def halves(w: Tensor) -> Tensor:  # each head's rows in HF's RoPE layout
        return w.view(-1, hd, w.shape[1])[:, order].reshape(w.shape)

    out = {"model.embed_tokens.weight": torch.randn(model.vocab_size, hid, generator=gen)}
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = halves(mat(qd, hid))
        out[p + "self_attn.k_proj.weight"] = halves(mat(kvd, hid))
        out[p + "self_attn.v_proj.weight"] = mat(kvd, hid)
        out[p + "self_attn.o_proj.weight"] = mat(hid, qd)
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = mat(ffn, hid)
        out[p + "mlp.up_proj.weight"] = mat(ffn, hid)
        out[p + "mlp.down_proj.weight"] = mat(hid, ffn)
    out["model.norm.weight"] = norm()
    out["lm_head.weight"] = mat(model.vocab_size, hid)
    return out


class TinyTransformer(HFTransformer):
    """The tiny model: ``HFTransformer`` over ``tiny_weights(model, seed)``, float32 on the CPU;
    ``config`` is its ``ModelConfig``."""

    def __init__(self, model: ModelConfig, seed: int = 0) -> None:
        super().__init__(tiny_spec(model), tiny_weights(model, seed), name=f"dualpath-{model.name}")
        self.config = model
