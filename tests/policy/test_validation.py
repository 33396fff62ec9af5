"""Bad input: clear ValueErrors, and nothing half-assigned."""

from __future__ import annotations

import pytest
from policy_testkit import de, pe, policy, req, view

from dualpath.policy import ClusterView, EngineState, NodeState, RequestInfo
from dualpath.types import EngineKind

GOOD = [pe(0, 0), pe(1, 0), de(10, 1, 10**6)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prompt_tokens": -5}, "prompt_tokens=-5"),
        ({"hit_tokens": -1}, "hit_tokens=-1"),
        ({"hit_tokens": 200}, "hit_tokens=200"),
        ({"output_tokens": 0}, "output_tokens=0"),
    ],
)
def test_bad_request(kw: dict[str, int], match: str) -> None:
    args = {"request_id": 1, "prompt_tokens": 100, "hit_tokens": 0, "output_tokens": 5, **kw}
    with pytest.raises(ValueError, match=match):
        RequestInfo(**args)


def test_submit_rejects_duplicates_and_bad_ids() -> None:
    p = policy()
    p.submit(req(1), 0.0)
    with pytest.raises(ValueError, match="already waiting"):
        p.submit(req(1), 0.0)
    with pytest.raises(ValueError, match="request_id=-3"):
        p.submit(req(-3), 0.0)
    with pytest.raises(ValueError, match="expected a RequestInfo"):
        p.submit("r", 0.0)  # type: ignore[arg-type]
    assert p.num_waiting == 1


def bad_views() -> list[tuple[ClusterView, str]]:
    n0, n1 = NodeState(0, EngineKind.PE), NodeState(1, EngineKind.DE)
    return [
        (ClusterView((GOOD[1], GOOD[0], GOOD[2]), (n0, n1)), "unique and sorted"),
        (ClusterView((GOOD[0], GOOD[0], GOOD[2]), (n0, n1)), "unique and sorted"),
        (ClusterView(tuple(GOOD), (n1, n0)), "node ids must be unique and sorted"),
        (ClusterView(tuple(GOOD), (n0,)), "node_id=1 is not in view.nodes"),
        (ClusterView((GOOD[0], de(5, 0, 10)), (n0, n1)), "kinds must match"),
        (ClusterView((EngineState(0, 0, -1, EngineKind.PE),), (n0,)), "group_id=-1"),
        (ClusterView((EngineState(0, 0, 0, EngineKind.PE, 1, True),), (n0,)), "tokens=True"),  # type: ignore[arg-type]
        # the rules an EngineState / NodeState once checked when built: now the policy's
        (ClusterView((pe(0, 0, seq=-1), *GOOD[1:]), (n0, n1)), "engine 0: seq=-1 is invalid"),
        (
            ClusterView((*GOOD[:2], de(10, 1, 10**6, tok=5, seq=0)), (n0, n1)),
            "engine 10: impossible state tokens=5 with seq=0",
        ),
        (
            ClusterView((*GOOD[:2], de(10, 1, -1)), (n0, n1)),
            "engine 10: free_hbm_tokens=-1 is invalid",
        ),
        (
            ClusterView(tuple(GOOD), (NodeState(0, EngineKind.PE, -1), n1)),
            "node 0: read_queue_tokens=-1 is invalid",
        ),
        (
            ClusterView(tuple(GOOD), (n0, NodeState(1, EngineKind.DE, 0, float("nan")))),
            "node 1: bytes_read=nan is invalid",
        ),
    ]


@pytest.mark.parametrize(("bad", "match"), bad_views())
def test_bad_view_rejected_before_any_change(bad: ClusterView, match: str) -> None:
    p = policy(record_decisions=True)
    for i in range(3):
        p.submit(req(i), 0.0)
    with pytest.raises(ValueError, match=match):
        p.schedule(bad, 0.0)
    assert p.num_waiting == 3 and p.num_holding_pe == 0 and p.decisions() == []
    fresh = policy(record_decisions=True)
    for i in range(3):
        fresh.submit(req(i), 0.0)
    assert p.schedule(view(GOOD), 1.0) == fresh.schedule(view(GOOD), 1.0)


def test_states_are_plain_data_checked_where_the_view_enters_the_policy() -> None:
    """An impossible state is built without complaint (a shell's ledger builds states at
    every pull) and refused, named, by the policy it is given to."""
    bad = EngineState(0, 0, 0, EngineKind.PE, seq=0, tokens=5)
    p = policy()
    p.submit(req(0), 0.0)
    with pytest.raises(ValueError, match="engine 0: impossible state tokens=5 with seq=0"):
        p.schedule(view([bad, GOOD[1], GOOD[2]]), 0.0)
    assert p.num_waiting == 1


def test_held_pe_missing_from_later_view() -> None:
    p = policy()
    p.submit(req(0), 0.0)
    assert p.schedule(view([pe(0, 0), de(10, 1, 5)]), 0.0) == []  # holds PE 0, no DE room
    with pytest.raises(ValueError, match="PE 0 holds 1 request"):
        p.schedule(view([pe(2, 0), de(10, 1, 10**6)]), 1.0)
    assert p.num_holding_pe == 1
    out = p.schedule(view([pe(0, 0), de(10, 1, 10**6)]), 2.0)
    assert [(a.request_id, a.pe) for a in out] == [(0, 0)]


def test_de_group_missing_from_later_view() -> None:
    p = policy()
    p.submit(req(0), 0.0)
    assert p.schedule(view([pe(0, 0), de(10, 1, 5, group=4)]), 0.0) == []
    with pytest.raises(ValueError, match="DE group 4 has 1 request"):
        p.schedule(view([pe(0, 0), de(10, 1, 10**6, group=0)]), 1.0)


@pytest.mark.parametrize(("bad", "match"), bad_views())
def test_bad_view_rejected_after_a_good_one_with_the_same_engines(
    bad: ClusterView, match: str
) -> None:
    """Engines that passed in an earlier view skip their field checks only when they are the
    same objects at the same index against the same node ids and kinds: reusing them in a
    bad view (reordered, against other nodes) is still caught."""
    n0, n1 = NodeState(0, EngineKind.PE), NodeState(1, EngineKind.DE)
    p = policy()
    assert p.schedule(ClusterView(tuple(GOOD), (n0, n1)), 0.0) == []
    p.submit(req(0), 0.0)
    with pytest.raises(ValueError, match=match):
        p.schedule(bad, 1.0)
    assert p.num_waiting == 1 and p.num_holding_pe == 0


def test_view_subclasses_are_always_checked_in_full() -> None:
    """Only plain ``ClusterView``s reuse the last check: a subclass view is checked field by
    field every time, even after an identical one passed (from the review)."""

    class MyView(ClusterView):
        pass

    n0, n1 = NodeState(0, EngineKind.PE), NodeState(1, EngineKind.DE)
    p = policy()
    assert p.schedule(MyView(tuple(GOOD), (n0, n1)), 0.0) == []
    p.submit(req(0), 0.0)
    with pytest.raises(ValueError, match=r"node_id=1 is not in view\.nodes"):
        p.schedule(MyView(tuple(GOOD), (n0,)), 1.0)
