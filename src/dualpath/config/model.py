"""Model architecture as the cost model and the runtime see it (design §10)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import one_of, positive, require
from dualpath.types import AttentionKind

_KIND_OF = {k.value: k for k in AttentionKind}

_ATTENTION_KINDS = tuple(k.value for k in AttentionKind)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer.

    KV bytes per token per layer are derived from the attention kind:
    GQA: ``2 · num_kv_heads · head_dim · kv_dtype_bytes``;
    MLA (dense or sparse): ``kv_lora_rank · kv_dtype_bytes + qk_rope_dim · rope_dtype_bytes
    + kv_scale_bytes`` (DeepSeek-V3.2's FP8 latent: 512 + 2·64 + 16 = 656 B).
    """

    name: str = "ds660b"
    attention: str = AttentionKind.MLA_SPARSE.value
    num_layers: int = 61
    hidden_size: int = 7168
    num_heads: int = 128  # query heads
    num_kv_heads: int = 128  # GQA only
    head_dim: int = 128  # GQA only
    kv_lora_rank: int = 512  # MLA latent width
    qk_rope_dim: int = 64  # MLA decoupled RoPE key width
    kv_dtype_bytes: int = 1  # latent (MLA) or K/V (GQA) element size
    rope_dtype_bytes: int = 2
    kv_scale_bytes: int = 16  # FP8 scales per token per layer (MLA)
    sparse_topk: int = 2048  # MLA_SPARSE: tokens each query attends to
    indexer_heads: int = 64  # MLA_SPARSE lightning indexer
    indexer_head_dim: int = 128
    # MLA_SPARSE: decode reads (and HBM holds) the indexer's key cache (docs/calibration.md)
    indexer_key_cache: bool = True
    active_params: float = 37e9
    total_params: float = 671e9
    num_routed_experts: int = 256
    experts_per_token: int = 8
    num_shared_experts: int = 1
    num_dense_layers: int = 3
    ffn_hidden_size: int = 18432  # dense FFN width (tiny/runtime: the only FFN)
    moe_intermediate_size: int = 2048
    vocab_size: int = 129280
    max_context_tokens: int = 131072
    compute_dtype: str = "fp8"  # dtype of prefill GEMMs: "fp8" or "bf16"
    weight_dtype_bytes: float = 1.0

    def __post_init__(self) -> None:
        one_of("model.attention", self.attention, _ATTENTION_KINDS)
        one_of("model.compute_dtype", self.compute_dtype, ("fp8", "bf16"))
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "kv_dtype_bytes",
            "active_params",
            "total_params",
            "vocab_size",
            "max_context_tokens",
            "weight_dtype_bytes",
            "ffn_hidden_size",
        ):
            positive(f"model.{name}", getattr(self, name))
        require(
            self.active_params <= self.total_params,
            "model.active_params",
            self.active_params,
            f"<= model.total_params ({self.total_params:g})",
        )
        if self.attention_kind is AttentionKind.GQA:
            require(
                self.num_heads % self.num_kv_heads == 0,
                "model.num_kv_heads",
                self.num_kv_heads,
                f"a divisor of model.num_heads ({self.num_heads})",
            )
        else:
            positive("model.kv_lora_rank", self.kv_lora_rank)
        if self.attention_kind is AttentionKind.MLA_SPARSE:
            positive("model.sparse_topk", self.sparse_topk)
            positive("model.indexer_heads", self.indexer_heads)
            positive("model.indexer_head_dim", self.indexer_head_dim)
        if self.num_routed_experts > 0:
            require(
                0 < self.experts_per_token <= self.num_routed_experts,
                "model.experts_per_token",
                self.experts_per_token,
                f"in 1..model.num_routed_experts ({self.num_routed_experts})",
            )

    @property
    def attention_kind(self) -> AttentionKind:
        return _KIND_OF[self.attention]  # a dict look-up: hot in the cost model

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        if self.attention_kind is AttentionKind.GQA:
            return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes
        return (
            self.kv_lora_rank * self.kv_dtype_bytes
            + self.qk_rope_dim * self.rope_dtype_bytes
            + self.kv_scale_bytes
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """All layers: the bytes one token's KV occupies in a Full Block."""
        return self.kv_bytes_per_token_per_layer * self.num_layers

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_dtype_bytes
