"""The reuse designs' rule (docs/peers.md): where a placed request's hit comes from, and the
affinity of PE and DE choices to the engines holding its KV."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from policy_testkit import de, params, pe, view

from dualpath.policy import RequestInfo, build_policy
from dualpath.policy.reuse import Resident, ReuseRule
from dualpath.types import ReadSide, ReuseSource

# two PEs on node 0, two DEs on node 1, two DEs on node 2
ENGINES = [
    pe(0, 0),
    pe(1, 0),
    de(10, 1, 10**6),
    de(11, 1, 10**6),
    de(20, 2, 10**6),
    de(21, 2, 10**6),
]


class Held:
    """A hand-made residency: agent → what is held where."""

    def __init__(self, held: dict[int, list[Resident]]) -> None:
        self.held = held

    def find(self, agent_id: int, now: float) -> Sequence[Resident]:
        return self.held.get(agent_id, [])


def run(
    mechanism: str,
    held: dict[int, list[Resident]],
    requests: list[RequestInfo],
    policy: str = "basic",
    read_q: dict[int, int] | None = None,
    **kw: object,
) -> list:  # type: ignore[type-arg]
    rule = ReuseRule(mechanism, **kw)  # type: ignore[arg-type]
    rule.residency = Held(held)
    p = build_policy(policy, params(beta_tokens=10**9), lambda pairs: 0.0, "round_robin", rule)
    for r in requests:
        p.submit(r, 0.0)
    return p.schedule(view(ENGINES, read_q), 0.0)


def r(rid: int, agent: int, hit: int = 640, prompt: int = 700) -> RequestInfo:
    return RequestInfo(rid, prompt, hit, 10, 0.0, agent)


def test_recompute_goes_to_the_pe_holding_the_prefix_and_computes_the_rest() -> None:
    held = {7: [Resident(ReuseSource.PE_HBM, 1, 512)]}
    (a,) = run("recompute", held, [r(0, 7)])
    assert a.pe == 1  # round robin alone would pick PE 0
    assert (a.reuse_source, a.reuse_tokens, a.recompute_tokens) == (ReuseSource.PE_HBM, 512, 128)
    assert (a.pe_read_tokens, a.de_read_tokens, a.read_side) == (0, 0, ReadSide.NONE)


def test_recompute_without_a_prefix_computes_the_whole_hit() -> None:
    (a,) = run("recompute", {}, [r(0, 7)])
    assert (a.reuse_tokens, a.recompute_tokens, a.pe_read_tokens) == (0, 640, 0)


def test_d2p_pulls_from_the_holding_de_a_hold_that_covers_the_hit() -> None:
    held = {3: [Resident(ReuseSource.DE_HBM, 21, 704)]}
    (a,) = run("d2p", held, [r(0, 3)])
    assert a.de == 21  # affinity: the DE that holds the blocks
    assert (a.reuse_source, a.reuse_node, a.reuse_engine) == (ReuseSource.DE_HBM, 2, 21)
    assert (a.reuse_tokens, a.pe_read_tokens, a.read_side) == (640, 0, ReadSide.NONE)
    # a hold short of the hit (a stale one) is not used: the hit is read from storage
    (b,) = run("d2p", {3: [Resident(ReuseSource.DE_HBM, 21, 576)]}, [r(0, 3)])
    assert (b.reuse_tokens, b.pe_read_tokens, b.read_side) == (0, 640, ReadSide.PE)


def test_d2p_pulls_from_another_de_when_its_own_has_no_room() -> None:
    held = {3: [Resident(ReuseSource.DE_HBM, 21, 704)]}
    engines = [e for e in ENGINES if e.engine_id != 21] + [de(21, 2, 100)]  # 100 free tokens
    rule = ReuseRule("d2p-evictable")  # evictable holds: no credit, DE 21 is too full
    rule.residency = Held(held)
    p = build_policy("basic", params(beta_tokens=10**9), lambda pairs: 0.0, "round_robin", rule)
    p.submit(r(0, 3), 0.0)
    (a,) = p.schedule(view(engines), 0.0)
    assert a.de != 21
    assert (a.reuse_source, a.reuse_node, a.reuse_engine) == (ReuseSource.PEER_HBM, 2, 21)
    assert a.reuse_tokens == 640


def test_d2p_with_nothing_held_is_basic() -> None:
    (a,) = run("d2p", {}, [r(0, 3)])
    (b,) = run("d2p", {}, [r(0, 3)])
    assert a == b
    assert (a.reuse_tokens, a.pe_read_tokens, a.read_side) == (0, 640, ReadSide.PE)


def test_both_read_reads_the_hit_on_both_nodes() -> None:
    (a,) = run("both-read", {}, [r(0, 1)])
    assert (a.pe_read_tokens, a.de_read_tokens, a.de_prefetch_tokens) == (640, 0, 640)


def test_dram_tier_local_then_peer_by_queue() -> None:
    local = {5: [Resident(ReuseSource.PE_DRAM, 0, 320)]}
    (a,) = run("dram-tier", local, [r(0, 5)])
    assert (a.reuse_source, a.reuse_tokens, a.pe_read_tokens) == (ReuseSource.PE_DRAM, 320, 320)
    peers = {
        5: [
            Resident(ReuseSource.PE_DRAM, 0, 320),
            Resident(ReuseSource.PE_DRAM, 1, 640),
            Resident(ReuseSource.PE_DRAM, 2, 640),
        ]
    }
    # without peer pull only the local tier counts
    (b,) = run("dram-tier", peers, [r(0, 5)])
    assert (b.reuse_source, b.reuse_tokens) == (ReuseSource.PE_DRAM, 320)
    # with it, the holder with the shorter read queue (node 2 here) serves the whole hit
    (c,) = run("dram-tier", peers, [r(0, 5)], read_q={1: 5000, 2: 0}, peer_pull=True)
    assert (c.reuse_source, c.reuse_node, c.reuse_tokens) == (ReuseSource.PEER_DRAM, 2, 640)
    assert c.pe_read_tokens == 0


def test_resident_reads_what_the_de_node_holds_and_the_rest_by_dualpaths_rule() -> None:
    held = {9: [Resident(ReuseSource.DE_DRAM, 2, 512)]}
    (a,) = run("resident", held, [r(0, 9)], policy="dualpath", read_q={0: 10_000, 1: 0, 2: 0})
    assert a.de in (20, 21)  # a DE on the node that holds it
    assert (a.reuse_source, a.reuse_node, a.reuse_tokens) == (ReuseSource.DE_DRAM, 2, 512)
    # the rest (128 tokens) goes to the shorter read queue: the DE node's
    assert (a.pe_read_tokens, a.de_read_tokens, a.read_side) == (0, 128, ReadSide.DE)


def test_hit_parts_add_up() -> None:
    held = {
        1: [Resident(ReuseSource.DE_HBM, 10, 6400)],  # more than the hit: capped at it
        2: [Resident(ReuseSource.DE_HBM, 11, 128)],  # less: not used
    }
    out = run("d2p", held, [r(0, 1), r(1, 2), r(2, 3, hit=0)])
    for a, hit in zip(out, (640, 640, 0), strict=True):
        parts = a.pe_read_tokens + a.de_read_tokens + a.reuse_tokens + a.recompute_tokens
        assert parts == hit


def test_a_mechanism_outside_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="reuse mechanism 'lmcache' is invalid"):
        ReuseRule("lmcache")
