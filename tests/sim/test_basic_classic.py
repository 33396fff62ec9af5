"""Basic is the classic path (design §8/§11): its batch's whole KV sits in HBM, so HBM caps it;
layerwise prefill (+Layer) lifts that cap, only the compute quota bounds its batch."""

from __future__ import annotations

import pytest

from dualpath.models import cost
from dualpath.policy.base import PendingPrefill
from dualpath.sim.cluster import Cluster
from dualpath.sim.prefill import PrefillGroup
from dualpath.sim.runner import build_cluster, run_cluster

from .conftest import small_config

# DS 27B 1P1D with 13 GB of HBM per GPU (5.4 GB of weights, 6 GB reserve): ≈ 79K tokens of KV
SMALL_HBM = ("hardware.hbm_bytes=13e9",)


def _group_and_cap(system: str) -> tuple[Cluster, PrefillGroup, int]:
    config = small_config("ds27b-1p1d", 8, "32k", *SMALL_HBM)
    cluster = build_cluster(config, system)
    group = cluster.prefill_groups[0]
    cap = cost.kv_capacity_tokens(config.model, config.hardware, len(group.members))
    return cluster, group, cap


def _batch_tokens(group: PrefillGroup, pe: int) -> int:
    # twelve turns of 30K cached + 500 new tokens queued at one PE
    queue = [PendingPrefill(i, 30_000, 500) for i in range(12)]
    batch = group.core.policy.plan_forward(pe, queue, 0.0, group.kv_budget_tokens)
    return sum(c.cached + c.new for c in batch.chunks)


def test_basic_batch_is_capped_by_hbm_and_layerwise_raises_it() -> None:
    _, basic, cap = _group_and_cap("basic")
    _, layer, _ = _group_and_cap("layer")
    assert basic.kv_budget_tokens == cap and 60_000 < cap < 90_000
    assert layer.kv_budget_tokens is None
    pe = basic.members[0]
    capped = _batch_tokens(basic, pe)
    lifted = _batch_tokens(layer, pe)
    assert capped <= cap  # two turns and a chunk of the third
    assert lifted > cap  # the quota, not HBM, bounds it
    assert lifted >= 2 * capped


def test_basic_passes_stay_within_hbm_in_a_run() -> None:
    cluster, group, cap = _group_and_cap("basic")
    run_cluster(cluster)
    assert cluster.num_turns_done == cluster.num_turns_total
    assert 0 < group.max_batch_tokens <= cap


def test_ds660b_64k_basic_batch_is_hbm_capped_at_nine_turns() -> None:
    # DS 660B EP16: 80 GB − 58 GB of weights − 6 GB reserve = 16 GB of KV per GPU, i.e.
    # 16.04e9 / (40,016 B of KV + 8,052 B of indexer key) ≈ 333,682 tokens: 9.98 turns of a
    # 64K-MAL context (33K cached + 430 new); +Layer holds one layer at a time, so all 24
    # queued turns fit in one pass.
    config = small_config("ds660b-2p4d", 2, "64k")
    basic = build_cluster(config, "basic").prefill_groups[0]
    layer = build_cluster(config, "layer").prefill_groups[0]
    cap = cost.kv_capacity_tokens(config.model, config.hardware, len(basic.members))
    assert basic.kv_budget_tokens == cap
    assert cap == pytest.approx((80e9 - 57.96e9 - 6e9) / (40_016 + 8_052), rel=1e-3)
    queue = [PendingPrefill(i, 33_000, 430) for i in range(24)]
    pe = basic.members[0]
    capped = basic.core.policy.plan_forward(pe, queue, 0.0, basic.kv_budget_tokens).chunks
    lifted = layer.core.policy.plan_forward(pe, queue, 0.0, layer.kv_budget_tokens).chunks
    assert sum(c.cached + c.new for c in capped) <= cap
    assert len([c for c in capped if c.new == 430]) == 9  # 333,682 // 33,430 = 9 whole turns
    assert len(lifted) == 24 and all(c.new == 430 for c in lifted)
