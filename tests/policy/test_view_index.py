"""The policy's view index: checked and updated only where the state objects changed, and
always equal to indexing the same view from scratch."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dualpath.policy import ClusterView, EngineState, NodeState
from dualpath.policy.state import ViewIndex
from dualpath.types import EngineKind

PE, DE = EngineKind.PE, EngineKind.DE


def _view() -> ClusterView:
    engines = [EngineState(e, e // 4, 0, PE) for e in range(8)]
    engines += [EngineState(e, e // 4, 2 + (e - 8) // 8 * 2, DE, 0, 0, 1000) for e in range(8, 24)]
    nodes = [NodeState(n, PE if n < 2 else DE) for n in range(6)]
    return ClusterView(tuple(engines), tuple(nodes))


def _numbers(index: ViewIndex) -> tuple[object, ...]:
    return (
        index.tok, index.seq, index.free, index.node, index.read_q, index.read_bytes,
        index.pe_groups, index.de_groups, index.pe_group_ids, index.de_group_ids,
        index.all_pes, index.de_group_of, index.de_tok_sum, index.de_free_sum,
    )  # fmt: skip


def test_incremental_refresh_equals_a_fresh_index() -> None:
    rng = random.Random(7)
    view = _view()
    index = ViewIndex()
    index.refresh(view, {}, {})
    for _ in range(200):
        engines, nodes = list(view.engines), list(view.nodes)
        for i in rng.sample(range(len(engines)), 3):
            seq = rng.randrange(3)
            engines[i] = replace(engines[i], seq=seq, tokens=rng.randrange(500) if seq else 0)
            if engines[i].kind is DE:
                engines[i] = replace(engines[i], free_hbm_tokens=rng.randrange(1000))
        n = rng.randrange(len(nodes))
        nodes[n] = replace(nodes[n], read_queue_tokens=rng.randrange(100))
        view = ClusterView(tuple(engines), tuple(nodes))
        index.refresh(view, {}, {})
        fresh = ViewIndex()
        fresh.refresh(view, {}, {})
        assert _numbers(index) == _numbers(fresh)


def test_a_changed_group_or_a_bad_count_falls_back_to_full_validation() -> None:
    view = _view()
    index = ViewIndex()
    index.refresh(view, {}, {})
    moved = list(view.engines)
    moved[9] = replace(moved[9], group_id=4)  # DE 9 joins another group
    index.refresh(ClusterView(tuple(moved), view.nodes), {}, {})
    assert 9 in index.de_groups[4] and 9 not in index.de_groups[2]
    bad = list(moved)
    bad[0] = EngineState(0, 0, 0, PE, seq=1, tokens=5)
    object.__setattr__(bad[0], "tokens", -5)  # an impossible state smuggled past __post_init__
    with pytest.raises(ValueError, match="tokens=-5"):
        index.refresh(ClusterView(tuple(bad), view.nodes), {}, {})
    assert index.tok[0] == 0  # a failed refresh changes nothing
