"""Cost model: design §10's cache-compute ratios, and the basic laws of each formula."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dualpath.config import HARDWARE_PRESETS, MODEL_PRESETS
from dualpath.models import cost

HW = HARDWARE_PRESETS["hopper"]
APPEND = 429
CONTEXTS = (16384, 32721, 65536)

# design §10: GB of hit KV per PFLOP of prefill at append 429 (16K → 64K, and ≈22 at 32.7K).
PAPER = {
    "qwen32b": {16384: 117.0, 65536: 267.0},
    "ds660b": {16384: 13.0, 32721: 22.0, 65536: 36.0},
    "deepseek-v3": {16384: 4.8, 65536: 5.8},
}


@pytest.mark.parametrize("model", ["qwen32b", "ds660b"])
@pytest.mark.parametrize("context", CONTEXTS)
def test_cache_compute_ratio_within_10_percent(model: str, context: int) -> None:
    ratio = cost.cache_compute_ratio_gb_per_pflop(MODEL_PRESETS[model], context, APPEND)
    paper = PAPER[model].get(context)
    if paper is None:  # the paper gives only the range ends: we must lie inside it
        lo, hi = PAPER[model][16384], PAPER[model][65536]
        assert lo * 0.9 <= ratio <= hi * 1.1
    else:
        assert ratio == pytest.approx(paper, rel=0.10)


@pytest.mark.parametrize("context", CONTEXTS)
def test_deepseek_v3_ratio_known_gap(context: int) -> None:
    """DeepSeek-V3 (dense MLA, absorbed attention FLOPs) lands 10.6–11.5% *below* the paper's
    4.8–5.8 (see docs/calibration.md: the paper's count implies ≈11% fewer attention FLOPs per
    query–key pair than absorbed MLA, for which we found no physical reason). We assert the
    measured band so any drift shows; the 10% target is not met for this model."""
    ratio = cost.cache_compute_ratio_gb_per_pflop(MODEL_PRESETS["deepseek-v3"], context, APPEND)
    lo, hi = PAPER["deepseek-v3"][16384], PAPER["deepseek-v3"][65536]
    assert lo * 0.88 <= ratio <= hi * 1.0
    if context in PAPER["deepseek-v3"]:
        assert ratio == pytest.approx(PAPER["deepseek-v3"][context], rel=0.12)


def test_ratio_ordering_matches_the_paper() -> None:
    """Qwen (dense GQA, big KV) ≫ V3.2 (sparse) ≫ V3 (dense MLA) at every context."""
    for ctx in CONTEXTS:
        q, v32, v3 = (
            cost.cache_compute_ratio_gb_per_pflop(MODEL_PRESETS[m], ctx, APPEND)
            for m in ("qwen32b", "ds660b", "deepseek-v3")
        )
        assert q > v32 > v3


def test_block_bytes() -> None:
    m = MODEL_PRESETS["ds660b"]
    assert cost.layer_block_bytes(m, 64) == 656 * 64
    assert cost.full_block_bytes(m, 64) == 656 * 64 * 61
    assert cost.full_block_bytes(m, 64) == m.num_layers * cost.layer_block_bytes(m, 64)


def test_linear_flops_two_per_active_param() -> None:
    m = MODEL_PRESETS["qwen32b"]
    assert cost.linear_flops(m, 10) == 2 * m.active_params * 10


def test_gqa_attention_flops_by_hand() -> None:
    m = MODEL_PRESETS["qwen32b"]
    # 2 new tokens after 3 cached: pairs = 4 + 5 = 9; 4·heads·head_dim per pair per layer
    assert cost.attention_flops(m, 3, 2) == 9 * 4 * 40 * 128 * 64


def test_sparse_attention_caps_main_attention_but_not_the_indexer() -> None:
    m = MODEL_PRESETS["ds660b"]
    short = cost.attention_main_flops(m, 1000, 1)
    at_cap = cost.attention_main_flops(m, m.sparse_topk - 1, 1)
    long = cost.attention_main_flops(m, 100_000, 1)
    assert short < at_cap == long
    assert cost.indexer_flops(m, 100_000, 1) > cost.indexer_flops(m, 1000, 1)
    assert cost.indexer_flops(MODEL_PRESETS["deepseek-v3"], 100_000, 1) == 0.0


def test_capped_pairs_matches_bruteforce() -> None:
    for cached, new, cap in [(0, 10, 4), (3, 5, 6), (10, 3, 4), (0, 0, 5), (5, 20, 100)]:
        brute = sum(min(cached + i, cap) for i in range(1, new + 1))
        assert cost._capped_pairs(cached, new, cap) == brute


def test_attention_time_is_additive_over_pairs() -> None:
    m = MODEL_PRESETS["ds660b"]
    a = cost.attention_time_s(m, HW, [(30000, 400)])
    b = cost.attention_time_s(m, HW, [(5000, 100)])
    assert cost.attention_time_s(m, HW, [(30000, 400), (5000, 100)]) == pytest.approx(a + b)
    assert cost.attention_time_s(m, HW, []) == 0.0


def test_prefill_time_and_throughput_are_consistent() -> None:
    m = MODEL_PRESETS["ds660b"]
    rate = cost.prefill_tokens_per_s(m, HW, 32768, 0.987)
    new = round(32768 * 0.013)
    t = cost.prefill_time_s(m, HW, [(32768 - new, new)])
    assert rate == pytest.approx(32768 / t)
    with pytest.raises(ValueError, match="hit_ratio"):
        cost.prefill_tokens_per_s(m, HW, 32768, 1.0)


def test_decode_roofline_grows_with_context_and_batch() -> None:
    m = MODEL_PRESETS["ds660b"]
    base = cost.decode_step_time_s(m, HW, 32, 32 * 20000, num_gpus=32)
    # sparse attention reads the KV of top-k tokens per request, and the indexer key of every
    # token: above top-k the step grows only by the indexer keys, by hand 32 × 40,000 tokens ×
    # 8,052 B / (3.35 TB/s × 0.8) = 3.846 ms (both steps memory-bound)
    longer = cost.decode_step_time_s(m, HW, 32, 32 * 60000, num_gpus=32)
    assert longer - base == pytest.approx(32 * 40_000 * 8_052 / (3.35e12 * 0.8), rel=1e-9)
    assert longer - base == pytest.approx(3.846e-3, abs=1e-6)
    # without the indexer key cache (the cost model before decode read the DSA indexer keys)
    # it did not grow at all
    off = replace(m, indexer_key_cache=False)
    assert cost.decode_step_time_s(off, HW, 32, 32 * 60000, num_gpus=32) == (
        cost.decode_step_time_s(off, HW, 32, 32 * 20000, num_gpus=32)
    )
    assert cost.decode_step_time_s(m, HW, 32, 32 * 1000, num_gpus=32) < base
    dense = MODEL_PRESETS["qwen32b"]
    assert cost.decode_step_time_s(dense, HW, 32, 32 * 20000) > cost.decode_step_time_s(
        dense, HW, 32, 32 * 10000
    )
    assert cost.decode_step_time_s(m, HW, 64, 64 * 20000, num_gpus=32) > base
    assert cost.decode_step_time_s(m, HW, 0, 0) == 0.0
    # memory bound: at least the weights one GPU reads over HBM bandwidth
    weights = cost.weight_bytes_per_gpu(m, 32)
    assert base >= weights / HW.hbm_bytes_per_s


def test_kv_capacity_accounts_for_weights() -> None:
    m = MODEL_PRESETS["ds660b"]
    ep32 = cost.kv_capacity_tokens(m, HW, 32)
    ep16 = cost.kv_capacity_tokens(m, HW, 16)
    assert ep32 > ep16 > 0
    free = HW.hbm_bytes - cost.weight_bytes_per_gpu(m, 32) - HW.activation_reserve_bytes
    # a resident token holds its KV (40,016 B) and its indexer key (8,052 B)
    assert ep32 == int(free // (m.kv_bytes_per_token + 8_052))
    # DS-V3.2's parameter split adds up to its total
    total = cost.replicated_params(m) + cost.routed_params_total(m)
    assert total == pytest.approx(m.total_params)


def test_moe_collectives_only_cross_nodes() -> None:
    m = MODEL_PRESETS["ds660b"]
    assert cost.moe_collective_bytes(m, 1000, 8) == 0.0  # one node: NVLink only
    assert cost.moe_collective_bytes(MODEL_PRESETS["qwen32b"], 1000, 16) == 0.0  # dense
    two = cost.moe_collective_bytes(m, 1000, 16)
    four = cost.moe_collective_bytes(m, 1000, 32)
    # 2 nodes, 8 experts: one remote node almost surely: 1 − (1/2)^8
    expected = 1000 * 58 * (1 - 0.5**8) * 7168 * 3
    assert two == pytest.approx(expected)
    assert four > two


@pytest.mark.parametrize("name", ["ds660b", "ds27b", "qwen32b", "deepseek-v3", "tiny"])
def test_attention_time_fn_is_bit_identical_to_attention_time_s(name: str) -> None:
    """The hoisted predictor is the same arithmetic as ``attention_time_s``, to the bit."""
    model, hw = MODEL_PRESETS[name], HARDWARE_PRESETS["hopper"]
    fast = cost.attention_time_fn(model, hw)
    rng = random.Random(3)
    for _ in range(300):
        pairs = [
            (
                rng.choice([0, 1, 63, 2047, 2048, 2049, rng.randint(0, 200_000)]),
                rng.randint(0, 9000),
            )
            for _ in range(rng.randint(0, 6))
        ]
        assert fast(pairs) == cost.attention_time_s(model, hw, pairs)


def test_indexer_key_bytes_by_hand() -> None:
    # one FP8 key of indexer_head_dim per token per layer (the indexer's heads are query
    # heads sharing it) + one FP32 scale per 128 values
    assert cost.indexer_key_bytes_per_token(MODEL_PRESETS["ds660b"]) == (128 + 4) * 61 == 8_052
    assert cost.indexer_key_bytes_per_token(MODEL_PRESETS["ds27b"]) == (64 + 4) * 30 == 2_040
    assert cost.indexer_key_bytes_per_token(MODEL_PRESETS["qwen32b"]) == 0
    off = replace(MODEL_PRESETS["ds660b"], indexer_key_cache=False)
    assert cost.indexer_key_bytes_per_token(off) == 0
    assert cost.hbm_bytes_per_token(off) == off.kv_bytes_per_token
    # design §10's stored KV (storage reads, loads, sends) does not include it
    assert MODEL_PRESETS["ds660b"].kv_bytes_per_token == 656 * 61
    # 64 requests of 33K tokens on one GPU: the indexer keys add 17.0 GB = 6.3 ms per step
    extra = 64 * 33_000 * 8_052
    assert extra == pytest.approx(17.0e9, rel=0.01)
    assert extra / (3.35e12 * 0.8) == pytest.approx(6.34e-3, rel=0.01)
