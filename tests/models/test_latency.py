"""Latency terms of the cost model, each checked against a hand computation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.config import HARDWARE_PRESETS, MODEL_PRESETS
from dualpath.models import cost

HW = HARDWARE_PRESETS["hopper"]
DS660B = MODEL_PRESETS["ds660b"]  # 61 layers, 3 dense: 58 MoE layers
QWEN = MODEL_PRESETS["qwen32b"]


def test_ep_latency_at_ep32_is_the_deepep_row_times_the_exposed_share() -> None:
    # (155 + 273) µs per MoE layer, half hidden by two-micro-batch overlap: 214 µs
    assert cost.ep_layer_latency_s(DS660B, HW, 32) == pytest.approx(214e-6, rel=1e-12)
    # over 58 MoE layers: 12.412 ms per step
    assert cost.ep_forward_latency_s(DS660B, HW, 32) == pytest.approx(58 * 214e-6, rel=1e-12)


def test_ep_latency_follows_the_table_over_ep_size() -> None:
    # EP16 row: (118 + 195) µs, half exposed = 156.5 µs
    assert cost.ep_layer_latency_s(DS660B, HW, 16) == pytest.approx(156.5e-6, rel=1e-12)
    # EP8 row and below: (77 + 114) / 2 = 95.5 µs
    assert cost.ep_layer_latency_s(DS660B, HW, 8) == pytest.approx(95.5e-6, rel=1e-12)
    assert cost.ep_layer_latency_s(DS660B, HW, 4) == pytest.approx(95.5e-6, rel=1e-12)
    # EP 48 is halfway (in log2) between 32 and 64 only approximately: log2(48) = 5.585
    w = (5.584962500721156 - 5.0) / 1.0
    d = 155 + w * (173 - 155)
    c = 273 + w * (314 - 273)
    assert cost.ep_layer_latency_s(DS660B, HW, 48) == pytest.approx((d + c) / 2 * 1e-6, rel=1e-9)
    # beyond the table: the EP256 row
    assert cost.ep_layer_latency_s(DS660B, HW, 1024) == pytest.approx(277e-6, rel=1e-12)


def test_ep_latency_is_zero_without_ep_or_experts_and_scales_with_overlap() -> None:
    assert cost.ep_layer_latency_s(DS660B, HW, 1) == 0.0
    assert cost.ep_layer_latency_s(QWEN, HW, 32) == 0.0  # dense model
    no_overlap = replace(HW, ep_overlap_share=0.0)
    assert cost.ep_layer_latency_s(DS660B, no_overlap, 32) == pytest.approx(428e-6, rel=1e-12)
    hidden = replace(HW, ep_overlap_share=1.0)
    assert cost.ep_layer_latency_s(DS660B, hidden, 32) == 0.0


def test_decode_step_adds_the_ep_latency_to_the_roofline() -> None:
    args = (DS660B, 64, 64 * 32_000)
    no_ep = cost.decode_step_time_s(*args[:1], HW, *args[1:], num_gpus=32)
    hw0 = replace(HW, ep_dispatch_latency_s=0.0, ep_combine_latency_s=0.0)
    base = cost.decode_step_time_s(DS660B, hw0, 64, 64 * 32_000, num_gpus=32)
    assert no_ep - base == pytest.approx(58 * 214e-6, rel=1e-9)


def test_prefill_fixed_cost_by_hand() -> None:
    # 4 ms per pass + 61 layers × 40 µs + 58 MoE layers × 156.5 µs (EP16)
    expected = 0.004 + 61 * 40e-6 + 58 * 156.5e-6
    assert cost.prefill_fixed_s(DS660B, HW, 16) == pytest.approx(expected, rel=1e-12)
    # a dense model without EP: only the overheads
    assert cost.prefill_fixed_s(QWEN, HW, 1) == pytest.approx(
        0.004 + QWEN.num_layers * 40e-6, rel=1e-12
    )


def test_prefill_linear_is_a_roofline_over_the_weights() -> None:
    bandwidth = HW.hbm_bytes_per_s * HW.hbm_efficiency
    weights_s = cost.weight_bytes_per_gpu(DS660B, 16) / bandwidth
    # one token: reading the GPU's weights dominates
    assert cost.prefill_linear_time_s(DS660B, HW, 1, 16) == pytest.approx(weights_s, rel=1e-12)
    # many tokens: the FLOPs at linear_mfu, as before
    big = 16_384
    flops_s = 2 * DS660B.active_params * big / (HW.gpu_fp8_flops * HW.linear_mfu)
    assert cost.prefill_linear_time_s(DS660B, HW, big, 16) == pytest.approx(flops_s, rel=1e-12)
    # the efficiency curve: below the ridge, time per token grows as the batch shrinks
    per_token = [cost.prefill_linear_time_s(DS660B, HW, t, 16) / t for t in (8, 64, 512, 4096)]
    assert per_token == sorted(per_token, reverse=True)
    assert cost.prefill_linear_time_s(DS660B, HW, 0, 16) == 0.0


def test_latency_constants_reject_bad_values() -> None:
    with pytest.raises(ValueError, match=r"hardware\.ep_overlap_share"):
        replace(HW, ep_overlap_share=1.5)
    with pytest.raises(ValueError, match=r"hardware\.prefill_layer_overhead_s"):
        replace(HW, prefill_layer_overhead_s=-1.0)


def test_hbm_dma_delay_by_hand() -> None:
    # 1.34 GB (a 33K-token DS 660B prompt) into HBM at 3.35 TB/s × 0.8 = 2.68 TB/s: 0.5 ms
    assert cost.hbm_dma_delay_s(HW, 1.34e9) == pytest.approx(1.34e9 / 2.68e12, rel=1e-12)
    assert cost.hbm_dma_delay_s(HW, 1.34e9) == pytest.approx(0.5e-3, rel=1e-12)
    doubled = replace(HW, hbm_dma_interference=2.0)
    assert cost.hbm_dma_delay_s(doubled, 1.34e9) == pytest.approx(1.0e-3, rel=1e-12)
    assert cost.hbm_dma_delay_s(replace(HW, hbm_dma_interference=0.0), 1.34e9) == 0.0
    assert cost.hbm_dma_delay_s(HW, 0.0) == 0.0
    with pytest.raises(ValueError, match=r"hardware\.hbm_dma_interference"):
        replace(HW, hbm_dma_interference=-0.5)
