"""What the engines hold beyond storage (the reuse designs' bookkeeping): LRU stores with a
capacity and a TTL, filled from the turns' prefills and ends."""

from __future__ import annotations

import math

import pytest

from dualpath.ledger.residency import LruTokens, Residency
from dualpath.ledger.turn import Turn
from dualpath.policy.reuse import Resident
from dualpath.types import ReuseSource


def test_lru_evicts_the_least_recently_used_first() -> None:
    s = LruTokens(1000)
    s.put(1, 400, 0.0)
    s.put(2, 400, 0.0)
    assert s.get(1, 1.0) == 400  # 1 is now the most recently used
    s.put(3, 400, 2.0)  # 1200 > 1000: agent 2 goes
    assert (s.get(1, 3.0), s.get(2, 3.0), s.get(3, 3.0)) == (400, 0, 400)
    assert (s.total, s.evicted_tokens) == (800, 400)


def test_lru_keeps_nothing_larger_than_itself_and_replaces_an_agents_entry() -> None:
    s = LruTokens(1000)
    s.put(1, 300, 0.0)
    s.put(1, 500, 1.0)
    assert (s.get(1, 1.0), s.total) == (500, 500)
    s.put(2, 1001, 1.0)
    assert (s.get(2, 1.0), s.total) == (0, 500)


def test_ttl_expires_entries_and_zero_keeps_nothing() -> None:
    s = LruTokens(1000, ttl_s=10.0)
    s.put(1, 100, 0.0)
    assert s.get(1, 10.0) == 100
    assert s.get(1, 10.5) == 0
    assert (s.total, s.expired_tokens) == (0, 100)
    z = LruTokens(1000, ttl_s=0.0)
    z.put(1, 100, 0.0)
    assert z.get(1, 0.0) == 0
    assert LruTokens(10).ttl_s == math.inf


def test_fit_shrinks_to_a_smaller_capacity() -> None:
    s = LruTokens(1000)
    for agent in range(4):
        s.put(agent, 200, float(agent))
    s.fit(450)
    assert s.total == 400 and s.get(0, 5.0) == 0 and s.get(1, 5.0) == 0


@pytest.mark.parametrize("bad", [{"capacity_tokens": -1}, {"capacity_tokens": 1, "ttl_s": -2.0}])
def test_bad_sizes_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="is invalid"):
        LruTokens(**bad)  # type: ignore[arg-type]


def turn(agent: int, pe: int, de: int, prompt: int = 1000, output: int = 100) -> Turn:
    t = Turn(0, agent, 0, prompt, 0, output, 0.0)
    t.pe, t.de = pe, de
    return t


# engines 0, 1 on node 0 (PEs); 2, 3 on node 1 (DEs)
LAYOUT = {"node_of": [0, 0, 1, 1], "pe_ids": [0, 1], "de_ids": [2, 3], "num_nodes": 2}


def test_recompute_holds_the_prompts_whole_blocks_on_its_pe() -> None:
    r = Residency("recompute", **LAYOUT, block_tokens=64, pe_capacity_tokens=10**6)
    r.prefill_done(turn(7, 1, 2), 0.0)
    assert r.find(7, 1.0) == [Resident(ReuseSource.PE_HBM, 1, 960)]
    r.finished(turn(7, 1, 2), 0, 2.0)  # the context is on the DE: not the PE's cache
    assert r.find(7, 3.0) == [Resident(ReuseSource.PE_HBM, 1, 960)]


def test_d2p_evictable_holds_yield_to_placed_turns_and_end_at_their_ttl() -> None:
    r = Residency("d2p-evictable", **LAYOUT, block_tokens=64, de_capacity_tokens=3000, ttl_s=100.0)
    r.finished(turn(1, 0, 2), 0, 0.0)  # 1100 → 1088 whole-block tokens held on DE 2
    r.finished(turn(2, 0, 2), 0, 1.0)
    assert r.find(1, 2.0) == [Resident(ReuseSource.DE_HBM, 2, 1088)]
    # turns placed on DE 2 take 1900 tokens: held blocks yield, least recently used first
    r.assigned(turn(3, 0, 2), 1900, 3.0)
    assert r.find(2, 3.0) == []  # agent 2 was used less recently than agent 1 (found at 2.0)
    assert r.find(1, 3.0) == [Resident(ReuseSource.DE_HBM, 2, 1088)]
    assert r.find(1, 200.0) == []  # past the TTL


def test_d2p_holds_are_pinned_until_pulled_or_expired() -> None:
    pinned: list[tuple[int, int]] = []
    r = Residency(
        "d2p",
        **LAYOUT,
        block_tokens=64,
        de_capacity_tokens=3000,
        ttl_s=100.0,
        on_pinned=lambda de, tokens: pinned.append((de, tokens)),
    )
    r.finished(turn(1, 0, 2), 0, 0.0)
    r.finished(turn(2, 0, 3), 0, 10.0)
    assert pinned == [(2, 1088), (3, 1088)]
    r.assigned(turn(3, 0, 2), 2900, 11.0)  # no room left on DE 2: the hold stays all the same
    assert r.find(1, 11.0) == [Resident(ReuseSource.DE_HBM, 2, 1088)]
    assert r.next_expiry_s() == 100.0
    r.expire(100.5)  # agent 1's TTL ended: DE 2's HBM is free again; agent 2's has not
    assert pinned[-1] == (2, 0) and r.find(1, 100.5) == [] and r.find(2, 100.5) != []
    # agent 2's next turn decodes on DE 2 and pulls its blocks from DE 3: the hold ends there
    nxt = turn(2, 0, 2)
    nxt.reuse_source = ReuseSource.PEER_HBM
    r.assigned(nxt, 1100, 101.0)
    assert pinned[-2:] == [(3, 0), (2, 0)] and r.find(2, 101.0) == []
    r.expire(200.0)  # the stale expiry of a hold already pulled changes nothing
    assert r.held_tokens() == 0 and r.expired_tokens() == 1088


def test_dram_tier_fills_the_pe_nodes_tier_then_the_de_nodes() -> None:
    r = Residency("dram-tier", **LAYOUT, block_tokens=64, dram_capacity_tokens=5000)
    t = turn(1, 1, 3)
    r.prefill_done(t, 0.0)
    r.finished(t, 0, 1.0)
    assert r.find(1, 2.0) == [
        Resident(ReuseSource.PE_DRAM, 0, 960),
        Resident(ReuseSource.PE_DRAM, 1, 1088),
    ]


def test_resident_keeps_the_context_on_the_de_node_and_both_read_holds_nothing() -> None:
    r = Residency("resident", **LAYOUT, block_tokens=64, dram_capacity_tokens=5000)
    r.finished(turn(1, 0, 3), 0, 1.0)
    assert r.find(1, 2.0) == [Resident(ReuseSource.DE_DRAM, 1, 1088)]
    b = Residency("both-read", **LAYOUT, block_tokens=64)
    b.prefill_done(turn(1, 0, 3), 0.0)
    b.finished(turn(1, 0, 3), 0, 1.0)
    assert b.find(1, 2.0) == []


def test_block_lru_evicts_the_least_recent_ranges_from_their_front() -> None:
    from dualpath.ledger.residency import BlockLru

    t = BlockLru(900)
    assert t.touch(1, 0, 400, 0.0) == 0  # agent 1 reads 400 tokens: all brought in
    assert t.touch(2, 0, 400, 1.0) == 0
    assert t.touch(1, 0, 400, 2.0) == 400  # all of it was held
    assert t.touch(1, 400, 600, 3.0) == 0  # its new blocks
    # 1000 > 900: agent 2's range is the least recent; its first 100 tokens go
    assert (t.total, t.evicted_tokens) == (900, 100)
    assert (t.held(1), t.held(2)) == (600, 300)
    # agent 2 reads its prefix again: 300 of its 400 were left (its tail), the rest comes
    # back; agent 1's oldest range (0..400, used at 2.0) gives up its first 100
    assert t.touch(2, 0, 400, 4.0) == 300
    assert (t.held(1), t.held(2), t.total, t.evicted_tokens) == (500, 400, 900, 200)


def test_block_lru_keeps_the_tail_of_a_range_larger_than_itself() -> None:
    from dualpath.ledger.residency import BlockLru

    t = BlockLru(256)
    assert t.touch(1, 0, 640, 0.0) == 0
    assert (t.held(1), t.total, t.evicted_tokens) == (256, 256, 384)
    assert t.touch(1, 0, 640, 1.0) == 256  # the last 256 tokens were still there
