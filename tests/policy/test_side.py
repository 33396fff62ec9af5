"""Read side (design §7.1): shorter read queue; baselines; split reads (beyond the paper)."""

from __future__ import annotations

import pytest
from policy_testkit import de, pe, policy, req, view

from dualpath.policy import split_hit
from dualpath.policy.side import SideRule
from dualpath.types import ReadSide

ENGINES = [pe(0, 0), de(10, 1, 10**9)]


def sides(name: str, read_q: dict[int, int], hits: list[int], **kw: object) -> list:  # type: ignore[type-arg]
    p = policy(name, beta_tokens=10**9, **kw)
    for i, h in enumerate(hits):
        p.submit(req(i, prompt=max(h, 1) + 64, hit=h), 0.0)
    return p.schedule(view(ENGINES, read_q), 0.0)


@pytest.mark.parametrize(
    ("read_q", "expected"),
    [
        ({0: 500, 1: 100}, ReadSide.DE),  # DE node's queue shorter
        ({0: 100, 1: 500}, ReadSide.PE),  # PE node's queue shorter
        ({0: 300, 1: 300}, ReadSide.PE),  # tie → PE (classic path)
    ],
)
def test_shorter_queue(read_q: dict[int, int], expected: ReadSide) -> None:
    (a,) = sides("dualpath", read_q, [640])
    assert a.read_side is expected
    assert (a.pe_read_tokens, a.de_read_tokens) == (
        (640, 0) if expected is ReadSide.PE else (0, 640)
    )


def test_read_q_updated_within_round() -> None:
    # PE node 0, DE node 100: first → DE (100 → 740); second → PE (0 < 740 → 640); third: tie
    # 640 vs 740 → PE
    out = sides("dualpath", {0: 0, 1: 100}, [640, 640, 640])
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.DE, ReadSide.PE]


def test_no_hit_reads_nothing() -> None:
    (a,) = sides("dualpath", {}, [0])
    assert (a.read_side, a.pe_read_tokens, a.de_read_tokens) == (ReadSide.NONE, 0, 0)


def test_basic_always_pe_side() -> None:
    out = sides("basic", {0: 10**9, 1: 0}, [640, 640])
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.PE]


def test_dpl_alternates_over_requests_with_hits() -> None:
    out = sides("dpl", {0: 0, 1: 10**9}, [640, 0, 640, 640])
    assert [a.read_side for a in out] == [ReadSide.PE, ReadSide.NONE, ReadSide.DE, ReadSide.PE]


@pytest.mark.parametrize(
    ("hit", "q_pe", "q_de", "alpha", "expected"),
    [
        (640, 0, 0, 1000, (320, 320)),  # equal headroom α: half each (5 blocks each)
        (640, 0, 500, 1000, (448, 192)),  # headroom 1000 : 500 ⇒ 6.67 : 3.33 blocks → 7 : 3
        (640, 5000, 0, 1000, (0, 640)),  # gap > hit: everything to the shorter queue
        (640, 3000, 2800, 1000, (192, 448)),  # above α: equalise to ≈ 3220 (3.44 → 3 blocks)
        (700, 0, 0, 1000, (380, 320)),  # partial block (60) joins the larger (tie: PE) share
        (64, 0, 0, 1000, (64, 0)),  # one block: 0.5 rounds to the PE
    ],
)
def test_split_hit(hit: int, q_pe: int, q_de: int, alpha: int, expected: tuple[int, int]) -> None:
    plan = split_hit(hit, q_pe, q_de, alpha, 64)
    assert (plan.pe_tokens, plan.de_tokens) == expected
    assert plan.pe_tokens + plan.de_tokens == hit
    assert plan.side is (ReadSide.PE if plan.pe_tokens >= plan.de_tokens else ReadSide.DE)


def test_split_reads_option_in_policy() -> None:
    (a,) = sides("dualpath", {0: 0, 1: 0}, [1280], split_reads=True)
    assert (a.pe_read_tokens, a.de_read_tokens) == (640, 640)
    (b,) = sides("dualpath", {0: 0, 1: 0}, [1280])  # off by default
    assert (b.pe_read_tokens, b.de_read_tokens) == (1280, 0)


def _with_read_bytes(read_q: dict[int, int], read: dict[int, float]):  # type: ignore[no-untyped-def]
    from dualpath.policy import ClusterView, NodeState
    from dualpath.types import EngineKind

    nodes = (
        NodeState(0, EngineKind.PE, read_q[0], read[0]),
        NodeState(1, EngineKind.DE, read_q[1], read[1]),
    )
    return ClusterView(view(ENGINES).engines, nodes)


@pytest.mark.parametrize(
    ("read_q", "read", "tie_break", "expected"),
    [
        ({0: 0, 1: 0}, {0: 5e9, 1: 1e9}, "least_read", ReadSide.DE),  # DE node read less
        ({0: 0, 1: 0}, {0: 1e9, 1: 5e9}, "least_read", ReadSide.PE),  # PE node read less
        ({0: 0, 1: 0}, {0: 2e9, 1: 2e9}, "least_read", ReadSide.PE),  # still a tie → PE
        ({0: 0, 1: 0}, {0: 5e9, 1: 1e9}, "pe", ReadSide.PE),  # default: tie → PE
        ({0: 900, 1: 100}, {0: 0.0, 1: 9e9}, "least_read", ReadSide.DE),  # queues decide first
    ],
)
def test_read_side_tie_break(
    read_q: dict[int, int], read: dict[int, float], tie_break: str, expected: ReadSide
) -> None:
    p = policy("dualpath", beta_tokens=10**9, read_tie_break=tie_break)
    p.submit(req(0, prompt=704, hit=640), 0.0)
    (a,) = p.schedule(_with_read_bytes(read_q, read), 0.0)
    assert a.read_side is expected


def test_bad_tie_break_and_bytes_read_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="read_tie_break='dice' is invalid"):
        policy("dualpath", read_tie_break="dice")
    with pytest.raises(ValueError, match=r"node 0: bytes_read=-1\.0 is invalid"):
        policy("dualpath").schedule(_with_read_bytes({0: 0, 1: 0}, {0: -1.0, 1: 0.0}), 0.0)


def test_the_write_side_spreads_writes_where_reads_are_spread() -> None:
    """DualPath and DPL (both read paths) persist a prompt through the node whose SNIC was
    given fewer bytes to write, a tie to the DE; Basic persists on the DE, as the paper."""
    both = SideRule("dualpath", 100, 10, split=False)
    assert both.write_node(0, 1, {0: 0.0, 1: 0.0}) == 1  # a tie: the DE
    assert both.write_node(0, 1, {0: 5.0, 1: 9.0}) == 0
    assert both.write_node(0, 1, {0: 9.0, 1: 5.0}) == 1
    assert SideRule("round_robin", 100, 10, split=False).write_node(2, 3, {3: 1.0}) == 2
    assert SideRule("pe", 100, 10, split=False).write_node(0, 1, {0: 0.0, 1: 9.0}) == 1
