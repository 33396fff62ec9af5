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
        index.tok,
        index.seq,
        index.free,
        index.node,
        index.read_q,
        index.read_bytes,
        index.pe_groups,
        index.de_groups,
        index.pe_group_ids,
        index.de_group_ids,
        index.all_pes,
        index.de_group_of,
        index.de_tok_sum,
        index.de_free_sum,
    )


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
    bad[0] = EngineState(0, 0, 0, PE, seq=1, tokens=-5)  # states check nothing when built
    with pytest.raises(ValueError, match="tokens=-5"):
        index.refresh(ClusterView(tuple(bad), view.nodes), {}, {})
    assert index.tok[0] == 0  # a failed refresh changes nothing


def _with_generated(view: ClusterView, generated: list[list[int]]) -> ClusterView:
    return ClusterView(view.engines, view.nodes, tuple(tuple(g) for g in generated))


def test_generated_tuples_refresh_like_a_fresh_index() -> None:
    """Decode steps (new ``generated`` tuples) and engine changes, mixed: the incremental
    index always equals a fresh one, and its group sums count the generated tokens."""
    rng = random.Random(11)
    view = _view()
    engines = [replace(e, seq=2, tokens=300) if e.kind is DE else e for e in view.engines]
    view = ClusterView(tuple(engines), view.nodes)
    generated = [[0] * 8, [0] * 8]  # DE groups 2 and 4, eight members each
    index = ViewIndex()
    index.refresh(_with_generated(view, generated), {}, {})
    for _ in range(200):
        g = rng.randrange(2)
        generated[g] = [x + rng.randrange(3) for x in generated[g]]
        if rng.random() < 0.3:  # a DE's own numbers change too
            engines = list(view.engines)
            i = rng.randrange(8, 24)
            engines[i] = replace(engines[i], tokens=rng.randrange(1, 500))
            view = ClusterView(tuple(engines), view.nodes)
        current = _with_generated(view, generated)
        index.refresh(current, {}, {})
        fresh = ViewIndex()
        fresh.refresh(current, {}, {})
        assert _numbers(index) == _numbers(fresh)
        assert index.de_tok_sum[2] == sum(e.tokens for e in view.engines[8:16]) + sum(generated[0])


@pytest.mark.parametrize(
    ("generated", "match"),
    [
        (((0,) * 8,), "1 entries for 2 DE groups"),
        (((0,) * 8, (0,) * 7), "DE group 4 has 8 members"),
        (((0,) * 8, (0,) * 7 + (-1,)), "engine 23: generated=-1 is invalid"),
        (((0,) * 8, (0,) * 7 + (5,)), "engine 23: impossible state generated=5 with seq=0"),
    ],
)
def test_bad_generated_tuples_are_named_and_change_nothing(
    generated: tuple[tuple[int, ...], ...], match: str
) -> None:
    view = _view()
    index = ViewIndex()
    index.refresh(_with_generated(view, [[0] * 8, [0] * 8]), {}, {})
    before = _numbers(index)
    with pytest.raises(ValueError, match=match):
        index.refresh(ClusterView(view.engines, view.nodes, generated), {}, {})
    assert _numbers(index) == before


def test_a_de_left_without_turns_must_report_nothing_generated() -> None:
    view = _view()
    engines = list(view.engines)
    engines[23] = replace(engines[23], seq=1, tokens=10)
    busy = ClusterView(tuple(engines), view.nodes, ((0,) * 8, (0,) * 7 + (5,)))
    index = ViewIndex()
    index.refresh(busy, {}, {})
    assert index.de_tok_sum[4] == 15
    engines[23] = replace(engines[23], seq=0, tokens=0)  # its turn left; the tuple did not
    with pytest.raises(ValueError, match="engine 23: impossible state generated=5 with seq=0"):
        index.refresh(ClusterView(tuple(engines), view.nodes, busy.generated), {}, {})
    assert index.de_tok_sum[4] == 15 and index.seq[23] == 1
