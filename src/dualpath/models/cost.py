"""Cost model: KV bytes, prefill FLOPs and time, decode step roofline, collective bytes.

Pure functions of (ModelConfig, HardwareConfig, sizes). Units are in the names. The
efficiency factors come from the hardware config (named calibration constants,
docs/calibration.md); nothing here is fitted to the paper's speedups.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from dualpath.config.hardware import HardwareConfig
from dualpath.config.model import ModelConfig
from dualpath.types import AttentionKind

# Node-limited routing (DeepSeek-V3): a token's experts span at most this many nodes.
MAX_ROUTED_NODES = 4

# DeepEP V1 low-latency kernels on H800 + CX7 400 Gb/s (128 tokens per rank, hidden 7168, top-8,
# FP8 dispatch, BF16 combine), github.com/deepseek-ai/DeepEP docs/legacy.md "Performance":
# (EP size, dispatch µs, combine µs). Only the shape over EP size is used here; the level is
# ``hw.ep_dispatch_latency_s`` / ``hw.ep_combine_latency_s`` (the EP32 row by default).
DEEPEP_LOW_LATENCY_H800_US = (
    (8, 77.0, 114.0),
    (16, 118.0, 195.0),
    (32, 155.0, 273.0),
    (64, 173.0, 314.0),
    (128, 192.0, 369.0),
    (256, 194.0, 360.0),
)
_EP_REFERENCE_SIZE = 32


# ---------------------------------------------------------------- bytes (design §3)
def kv_bytes_per_token(model: ModelConfig) -> int:
    """KV bytes of one token over all layers (one row of a Full Block)."""
    return model.kv_bytes_per_token


def layer_block_bytes(model: ModelConfig, block_tokens: int) -> int:
    """One layer's KV for ``block_tokens`` tokens, shape [1, tokens, bytes]."""
    return model.kv_bytes_per_token_per_layer * block_tokens


def full_block_bytes(model: ModelConfig, block_tokens: int) -> int:
    """All layers for the same tokens, layer-major: ``num_layers`` Layer Blocks."""
    return model.kv_bytes_per_token * block_tokens


# DeepSeek-V3.2's lightning indexer caches one key per token per layer: its query heads
# (``indexer_heads``) share that key (MQA), so the key is ``indexer_head_dim`` FP8 values plus
# one FP32 scale per block of 128 values (DeepSeek-V3.2-Exp inference/model.py, ``Indexer``:
# ``k_cache`` float8_e4m3 of head_dim, ``k_scale_cache`` float32 of head_dim // 128; the same
# 128 + 4 B layout in SGLang's and LightLLM's V3.2 indexer caches).
INDEXER_KEY_DTYPE_BYTES = 1  # FP8
INDEXER_KEY_SCALE_BYTES = 4  # FP32, one per quantisation block
INDEXER_KEY_QUANT_BLOCK = 128  # values per scale


def indexer_key_bytes_per_token(model: ModelConfig) -> int:
    """Indexer key-cache bytes of one token over all layers (0 unless ``MLA_SPARSE`` with
    ``model.indexer_key_cache``): DS 660B (128 + 4) × 61 = 8,052 B; DS 27B (64 + 4) × 30 =
    2,040 B. Not part of ``kv_bytes_per_token`` (design §3/§10 size the stored KV without it:
    storage reads, loads and sends do not move it, docs/calibration.md "Indexer keys")."""
    if model.attention_kind is not AttentionKind.MLA_SPARSE or not model.indexer_key_cache:
        return 0
    dim = model.indexer_head_dim
    scales = -(-dim // INDEXER_KEY_QUANT_BLOCK)
    return (dim * INDEXER_KEY_DTYPE_BYTES + scales * INDEXER_KEY_SCALE_BYTES) * model.num_layers


def hbm_bytes_per_token(model: ModelConfig) -> int:
    """HBM one resident token takes: its KV plus its indexer key (sparse models)."""
    return kv_bytes_per_token(model) + indexer_key_bytes_per_token(model)


# ---------------------------------------------------------------- parameters
def moe_layers(model: ModelConfig) -> int:
    return model.num_layers - model.num_dense_layers if model.is_moe else 0


def expert_params(model: ModelConfig) -> float:
    """Parameters of one routed expert (gate, up, down projections)."""
    return 3.0 * model.hidden_size * model.moe_intermediate_size


def routed_params_total(model: ModelConfig) -> float:
    return expert_params(model) * model.num_routed_experts * moe_layers(model)


def routed_params_active(model: ModelConfig) -> float:
    return expert_params(model) * model.experts_per_token * moe_layers(model)


def replicated_params(model: ModelConfig) -> float:
    """Parameters every GPU of a data-parallel-attention EP group holds (all but routed experts)."""
    return max(model.total_params - routed_params_total(model), 0.0)


# ---------------------------------------------------------------- FLOPs
def linear_flops(model: ModelConfig, new_tokens: int) -> float:
    """GEMM FLOPs of computing ``new_tokens`` tokens: 2 × active parameters per token."""
    return 2.0 * model.active_params * new_tokens


def _causal_pairs(cached: int, new: int) -> float:
    """Σ_{i=1..new} (cached + i): query–key pairs of ``new`` tokens after ``cached`` tokens."""
    return new * cached + new * (new + 1) / 2.0


def _capped_pairs(cached: int, new: int, cap: int) -> float:
    """Σ_{i=1..new} min(cached + i, cap): pairs when each query attends at most ``cap`` keys."""
    if new <= 0:
        return 0.0
    # queries i with cached + i <= cap see cached + i keys; the rest see cap keys
    n_under = max(0, min(new, cap - cached))
    under = n_under * cached + n_under * (n_under + 1) / 2.0
    return under + (new - n_under) * float(cap)


def _attention_flops_per_pair_per_layer(model: ModelConfig) -> float:
    kind = model.attention_kind
    if kind is AttentionKind.GQA:  # QKᵀ and AV over head_dim, per query head
        return 4.0 * model.num_heads * model.head_dim
    # MLA with absorbed projections: QKᵀ over latent + rope, AV over the latent
    latent = model.kv_lora_rank
    return 2.0 * model.num_heads * (latent + model.qk_rope_dim) + 2.0 * model.num_heads * latent


def _indexer_flops_per_pair_per_layer(model: ModelConfig) -> float:
    return 2.0 * model.indexer_heads * model.indexer_head_dim


def attention_main_flops(model: ModelConfig, cached_tokens: int, new_tokens: int) -> float:
    """Core attention FLOPs over all layers (sparse models attend ``sparse_topk`` keys)."""
    if model.attention_kind is AttentionKind.MLA_SPARSE:
        pairs = _capped_pairs(cached_tokens, new_tokens, model.sparse_topk)
    else:
        pairs = _causal_pairs(cached_tokens, new_tokens)
    return pairs * _attention_flops_per_pair_per_layer(model) * model.num_layers


def indexer_flops(model: ModelConfig, cached_tokens: int, new_tokens: int) -> float:
    """Lightning-indexer FLOPs (sparse models): every query scores every earlier key."""
    if model.attention_kind is not AttentionKind.MLA_SPARSE:
        return 0.0
    pairs = _causal_pairs(cached_tokens, new_tokens)
    return pairs * _indexer_flops_per_pair_per_layer(model) * model.num_layers


def attention_flops(model: ModelConfig, cached_tokens: int, new_tokens: int) -> float:
    """All attention FLOPs of ``new_tokens`` queries after ``cached_tokens`` keys, all layers."""
    return attention_main_flops(model, cached_tokens, new_tokens) + indexer_flops(
        model, cached_tokens, new_tokens
    )


def prefill_flops(model: ModelConfig, cached_tokens: int, new_tokens: int) -> float:
    return linear_flops(model, new_tokens) + attention_flops(model, cached_tokens, new_tokens)


def cache_compute_ratio_gb_per_pflop(
    model: ModelConfig, context_tokens: int, append_tokens: int
) -> float:
    """design §10: GB of hit KV per PFLOP of prefill for one turn (hit = context, new = append)."""
    hit_gb = context_tokens * kv_bytes_per_token(model) / 1e9
    pflop = prefill_flops(model, context_tokens, append_tokens) / 1e15
    return hit_gb / pflop


# ---------------------------------------------------------------- seconds
def _linear_peak_flops(model: ModelConfig, hw: HardwareConfig) -> float:
    return hw.gpu_fp8_flops if model.compute_dtype == "fp8" else hw.gpu_bf16_flops


def linear_time_s(model: ModelConfig, hw: HardwareConfig, tokens: float) -> float:
    """GEMM time of ``tokens`` tokens on one GPU (EP group: group tokens / group size)."""
    return linear_flops(model, 1) * tokens / (_linear_peak_flops(model, hw) * hw.linear_mfu)


def attention_time_s(
    model: ModelConfig, hw: HardwareConfig, pairs: Sequence[tuple[int, int]]
) -> float:
    """design §7.2 predictor: attention time of one GPU's batch of ``(cached, bsz)`` pairs.

    Core attention runs at the BF16 peak, the sparse indexer at the FP8 peak, both scaled by
    ``hw.attention_mfu``.
    """
    main = 0.0
    index = 0.0
    for cached, bsz in pairs:
        main += attention_main_flops(model, cached, bsz)
        index += indexer_flops(model, cached, bsz)
    eff = hw.attention_mfu
    return main / (hw.gpu_bf16_flops * eff) + index / (hw.gpu_fp8_flops * eff)


def attention_time_fn(
    model: ModelConfig, hw: HardwareConfig
) -> Callable[[Sequence[tuple[int, int]]], float]:
    """``attention_time_s`` bound to ``model`` and ``hw``, with the per-model constants
    hoisted out of the per-pair loop (the scheduler's predictor calls it in a binary search).
    Same floating-point operations in the same order, so bit-identical
    (``tests/models/test_cost.py``)."""
    sparse = model.attention_kind is AttentionKind.MLA_SPARSE
    per_pair = _attention_flops_per_pair_per_layer(model)
    index_per_pair = _indexer_flops_per_pair_per_layer(model)
    layers = model.num_layers
    cap = model.sparse_topk
    main_peak = hw.gpu_bf16_flops * hw.attention_mfu
    index_peak = hw.gpu_fp8_flops * hw.attention_mfu

    def attention_time(pairs: Sequence[tuple[int, int]]) -> float:
        main = 0.0
        index = 0.0
        for cached, new in pairs:
            causal = new * cached + new * (new + 1) / 2.0  # _causal_pairs
            if sparse:
                if new <= 0:
                    capped = 0.0
                else:  # _capped_pairs
                    n_under = max(0, min(new, cap - cached))
                    under = n_under * cached + n_under * (n_under + 1) / 2.0
                    capped = under + (new - n_under) * float(cap)
                main += capped * per_pair * layers
                index += causal * index_per_pair * layers
            else:
                main += causal * per_pair * layers
        return main / main_peak + index / index_peak

    return attention_time


def prefill_time_s(
    model: ModelConfig, hw: HardwareConfig, pairs: Sequence[tuple[int, int]]
) -> float:
    """Linear + attention time of one GPU's batch (data parallel, no collectives)."""
    tokens = sum(bsz for _, bsz in pairs)
    return linear_time_s(model, hw, tokens) + attention_time_s(model, hw, pairs)


def prefill_tokens_per_s(
    model: ModelConfig, hw: HardwareConfig, prompt_tokens: int, hit_ratio: float
) -> float:
    """Prompt tokens (cached + new) per second one GPU prefills at ``hit_ratio`` (for β)."""
    if prompt_tokens <= 0:
        raise ValueError(f"prompt_tokens={prompt_tokens} is invalid: must be > 0")
    if not 0.0 <= hit_ratio < 1.0:
        raise ValueError(f"hit_ratio={hit_ratio} is invalid: must be in [0, 1)")
    new = max(1, round(prompt_tokens * (1.0 - hit_ratio)))
    return prompt_tokens / prefill_time_s(model, hw, [(prompt_tokens - new, new)])


def weight_bytes_per_gpu(model: ModelConfig, num_gpus: int) -> float:
    """Weights one GPU holds: replicated part + its share of the routed experts (EP)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus} is invalid: must be >= 1")
    params = replicated_params(model) + routed_params_total(model) / num_gpus
    return params * model.weight_dtype_bytes


def kv_capacity_tokens(model: ModelConfig, hw: HardwareConfig, num_gpus: int) -> int:
    """KV tokens that fit in one GPU's HBM after weights and the activation reserve (a token
    takes ``hbm_bytes_per_token``: its KV and, on sparse models, its indexer key)."""
    free = hw.hbm_bytes - weight_bytes_per_gpu(model, num_gpus) - hw.activation_reserve_bytes
    return max(0, int(free // hbm_bytes_per_token(model)))


def _decode_kv_read_bytes(model: ModelConfig, batch_size: int, context_tokens: int) -> float:
    """KV bytes one decode step reads for a batch holding ``context_tokens`` tokens in total:
    sparse models read the KV of at most ``sparse_topk`` tokens per request and the indexer
    key of every token of the context (the indexer scores every earlier token each step,
    docs/calibration.md "Indexer keys")."""
    per_token = kv_bytes_per_token(model)
    if model.attention_kind is not AttentionKind.MLA_SPARSE or batch_size == 0:
        return float(context_tokens) * per_token
    mean_ctx = context_tokens / batch_size
    kv = batch_size * min(mean_ctx, float(model.sparse_topk)) * per_token
    return kv + float(context_tokens) * indexer_key_bytes_per_token(model)


# ---------------------------------------------------------------- latency terms
def _table_shape(ep_size: int, column: int) -> float:
    """DeepEP latency at ``ep_size`` relative to EP32 (piecewise linear in log2(EP), clamped)."""
    rows = DEEPEP_LOW_LATENCY_H800_US
    ref = next(r[column] for r in rows if r[0] == _EP_REFERENCE_SIZE)
    if ep_size <= rows[0][0]:
        return rows[0][column] / ref
    for lo, hi in itertools.pairwise(rows):
        if ep_size <= hi[0]:
            a, b = math.log2(lo[0]), math.log2(hi[0])
            w = (math.log2(ep_size) - a) / (b - a)
            return (lo[column] + w * (hi[column] - lo[column])) / ref
    return rows[-1][column] / ref


def ep_layer_latency_s(model: ModelConfig, hw: HardwareConfig, ep_size: int) -> float:
    """Exposed latency of one MoE layer's dispatch + combine in an EP group of ``ep_size`` GPUs.

    ``hw.ep_dispatch_latency_s`` + ``hw.ep_combine_latency_s`` (EP32) scaled by DeepEP's
    published shape over EP size, times the share two-micro-batch overlap does not hide
    ``(1 - hw.ep_overlap_share)``. 0 for dense models and without EP (``ep_size <= 1``).
    """
    if not model.is_moe or ep_size <= 1:
        return 0.0
    dispatch = hw.ep_dispatch_latency_s * _table_shape(ep_size, 1)
    combine = hw.ep_combine_latency_s * _table_shape(ep_size, 2)
    return (dispatch + combine) * (1.0 - hw.ep_overlap_share)


def ep_forward_latency_s(model: ModelConfig, hw: HardwareConfig, ep_size: int) -> float:
    """``ep_layer_latency_s`` over all MoE layers: what one forward pass (step) waits on EP."""
    return ep_layer_latency_s(model, hw, ep_size) * moe_layers(model)


def prefill_fixed_s(model: ModelConfig, hw: HardwareConfig, ep_size: int) -> float:
    """Fixed time of one prefill forward pass, independent of its tokens: per-pass overhead,
    per-layer overhead × layers, EP dispatch/combine latency over the MoE layers."""
    return (
        hw.prefill_pass_overhead_s
        + hw.prefill_layer_overhead_s * model.num_layers
        + ep_forward_latency_s(model, hw, ep_size)
    )


def prefill_linear_time_s(
    model: ModelConfig, hw: HardwareConfig, tokens: float, ep_size: int = 1
) -> float:
    """GEMM time of one GPU's ``tokens`` in a prefill pass, as a roofline: the FLOPs at
    ``linear_mfu`` or, for small batches, reading the GPU's weights once from HBM
    (``weight_bytes_per_gpu / (hbm_bytes_per_s · hbm_efficiency)``), whichever is longer.

    This is the small-batch efficiency curve of the (MoE) GEMMs: effective efficiency
    ``linear_mfu · min(1, tokens / tokens_at_ridge)``. It adds no constant of its own.
    """
    if tokens <= 0:
        return 0.0
    compute_s = linear_time_s(model, hw, tokens)
    weights_s = weight_bytes_per_gpu(model, max(1, ep_size)) / (
        hw.hbm_bytes_per_s * hw.hbm_efficiency
    )
    return max(compute_s, weights_s)


def kv_read_slowdown(hw: HardwareConfig) -> float:
    """How much slower decode attention reads a KV byte than the step reads a weight byte:
    ``hbm_efficiency / kv_read_efficiency`` (1.0 on the GPU presets, where both are 0.80;
    larger on a CPU host, where weights stay in cache and attention gathers KV pages)."""
    return hw.hbm_efficiency / hw.kv_read_efficiency


def decode_step_time_s(
    model: ModelConfig,
    hw: HardwareConfig,
    batch_size: int,
    context_tokens: int,
    num_gpus: int = 1,
) -> float:
    """Roofline of one decode step of one GPU: max(HBM bytes / bandwidth, FLOPs / peak)
    + overhead + EP dispatch/combine latency over the MoE layers (``num_gpus`` = EP size).

    Bytes: the weights a step touches (replicated part + the GPU's expert share; with EP a
    decode batch touches all local experts) at ``hbm_efficiency`` and the KV the batch
    attends at ``kv_read_efficiency``. FLOPs: 2 × active params per request plus one
    query's attention per request.
    """
    if batch_size <= 0:
        return 0.0
    weight_bytes = weight_bytes_per_gpu(model, num_gpus)
    kv_bytes = _decode_kv_read_bytes(model, batch_size, context_tokens)
    mean_ctx = context_tokens // batch_size
    flops = linear_flops(model, batch_size) + batch_size * attention_flops(model, mean_ctx, 1)
    memory_s = (weight_bytes + kv_bytes * kv_read_slowdown(hw)) / (
        hw.hbm_bytes_per_s * hw.hbm_efficiency
    )
    compute_s = flops / (_linear_peak_flops(model, hw) * hw.linear_mfu)
    return (
        max(memory_s, compute_s)
        + hw.decode_step_overhead_s
        + ep_forward_latency_s(model, hw, num_gpus)
    )


def hbm_dma_delay_s(hw: HardwareConfig, dma_bytes: float) -> float:
    """Decode-step time lost when ``dma_bytes`` are copied into or out of a GPU's HBM while
    it decodes: ``dma_bytes · hbm_dma_interference / (hbm_bytes_per_s · hbm_efficiency)``.

    A decode step is HBM-bound (the roofline's memory side); a DMA (H2D through the CNIC, or
    D2H) is served by the same HBM, so each byte it moves displaces
    ``hbm_dma_interference`` bytes of the step's reads. Contention model of the decode node,
    docs/calibration.md.
    """
    if dma_bytes <= 0:
        return 0.0
    return dma_bytes * hw.hbm_dma_interference / (hw.hbm_bytes_per_s * hw.hbm_efficiency)


def moe_collective_bytes(
    model: ModelConfig, tokens: int, ep_size: int, gpus_per_node: int = 8
) -> float:
    """Bytes one GPU sends over its CNIC (and receives, symmetric) for MoE dispatch + combine of
    ``tokens`` tokens in one forward pass (design §13.8).

    Intra-node traffic rides NVLink; only traffic to other nodes crosses the CNIC. A token's
    ``experts_per_token`` experts land on E[distinct remote nodes] = (N−1)(1 − (1 − 1/N)^k) of
    the N = ep_size / gpus_per_node nodes (uniform routing), capped by node-limited routing;
    each remote node receives the token once (FP8 dispatch) and returns it once (BF16 combine).
    """
    if not model.is_moe or ep_size <= 1 or tokens <= 0:
        return 0.0
    nodes = max(1, ep_size // gpus_per_node)
    if nodes <= 1:
        return 0.0
    k = model.experts_per_token
    remote = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** k)
    remote = min(remote, float(MAX_ROUTED_NODES))
    per_token_layer = remote * model.hidden_size * (1 + 2)  # FP8 out + BF16 back
    return tokens * moe_layers(model) * per_token_layer
