"""PE assignment (design §7.1): α/β categories, smallest tok_e, FIFO, baselines' choices."""

from __future__ import annotations

import pytest
from policy_testkit import de, pe, policy, req, view

# Two PE nodes (0, 1) with two PEs each, one roomy DE node (2) so every PE choice completes.
BIG_DE = [de(10, 2, free=10**9)]


def pe_choices(p, v, n):  # type: ignore[no-untyped-def]
    for i in range(n):
        p.submit(req(i), 0.0)
    return [a.pe for a in p.schedule(v, 0.0)]


@pytest.mark.parametrize(
    ("case", "pes", "read_q", "expected"),
    [
        # category 2 (node read_q ≤ α) beats category 3 even with more tokens
        ("cat2 preferred", [pe(0, 0, 5000), pe(1, 1, 10)], {0: 1000, 1: 1001}, [0]),
        # within a category: smallest tok_e
        ("smallest tok", [pe(0, 0, 300), pe(1, 0, 200)], {}, [1]),
        # tie on tok_e: lowest engine id
        ("tie lowest id", [pe(3, 0, 50), pe(1, 0, 50)], {}, [1]),
        # category 1 (tok_e > β = 10,000) never assigned, even if its node is idle
        ("overloaded skipped", [pe(0, 0, 10_001), pe(1, 1, 9_000)], {1: 5000}, [1]),
        # only category 3 left: still assigned, smallest tok_e
        ("cat3 fallback", [pe(0, 0, 700), pe(1, 1, 600)], {0: 2000, 1: 3000}, [1]),
        # tok_e == β is not overloaded (only tok_e > β is)
        ("beta inclusive", [pe(0, 0, 10_000)], {}, [0]),
    ],
)
def test_single_choice(case: str, pes, read_q, expected) -> None:  # type: ignore[no-untyped-def]
    p = policy()
    assert pe_choices(p, view(pes + BIG_DE, read_q), 1) == expected, case


def test_tok_updates_and_repeat() -> None:
    # prompt 100 each: PE0 (0) and PE1 (150) alternate as their tok_e grow
    p = policy()
    v = view([pe(0, 0, 0), pe(1, 0, 150), *BIG_DE])
    assert pe_choices(p, v, 5) == [0, 0, 1, 0, 1]


def test_stops_when_all_overloaded_and_keeps_fifo() -> None:
    # β = 250: PE0 0→100→200, tie at 200 goes to PE0 (lowest id) →300 > β; PE1 200→300
    p = policy(beta_tokens=250)
    v = view([pe(0, 0, 0), pe(1, 0, 200), *BIG_DE])
    for i in range(10):
        p.submit(req(i), 0.0)
    out = p.schedule(v, 0.0)
    assert sorted(a.request_id for a in out) == [0, 1, 2, 3]  # a FIFO prefix
    assert p.num_waiting == 6
    assert [a.pe for a in sorted(out, key=lambda a: a.request_id)] == [0, 0, 0, 1]


def test_groups_pulling_together_share_one_pull() -> None:
    # per-node groups pulling in one round: each head request goes to the least-loaded PE of
    # any group (ties: lowest id), not to the first group until its PEs pass β
    p = policy(beta_tokens=150)
    v = view([pe(0, 0, 0, group=0), pe(1, 1, 0, group=1), *BIG_DE])
    assert pe_choices(p, v, 3) == [0, 1, 0]
    p = policy(beta_tokens=400)
    v = view([pe(0, 0, 120, group=0), pe(1, 1, 20, group=1), *BIG_DE])
    assert pe_choices(p, v, 5) == [1, 0, 1, 0, 1]


def test_groups_pulling_together_prefer_a_short_read_queue_anywhere() -> None:
    # category 2 (node read_q ≤ α) in group 1 beats a less-loaded category-3 PE in group 0
    p = policy()
    v = view([pe(0, 0, 10, group=0), pe(1, 1, 900, group=1), *BIG_DE], {0: 5000, 1: 0})
    assert pe_choices(p, v, 1) == [1]


def test_held_pe_tokens_count_next_round() -> None:
    # No DE room: the request keeps PE0; next round PE0's tok_e includes it, so PE1 is chosen
    p = policy()
    tiny = [de(10, 2, free=5)]
    p.submit(req(0, prompt=500), 0.0)
    assert p.schedule(view([pe(0, 0, 0), pe(1, 0, 100), *tiny]), 0.0) == []
    assert p.num_holding_pe == 1
    p.submit(req(1), 1.0)
    out = p.schedule(view([pe(0, 0, 0), pe(1, 0, 100), *BIG_DE]), 1.0)
    assert [(a.request_id, a.pe) for a in out] == [(0, 0), (1, 1)]
    assert p.num_waiting == 0


def test_round_robin_cycles_and_skips_overloaded() -> None:
    p = policy("basic", beta_tokens=10_000)
    v = view([pe(0, 0, 0), pe(1, 0, 20_000), pe(2, 1, 9_000), *BIG_DE])
    assert pe_choices(p, v, 4) == [0, 2, 0, 2]  # PE1 overloaded
    # the cursor survives rounds: next choice after PE2 wraps to PE0
    p.submit(req(99), 1.0)
    assert [a.pe for a in p.schedule(v, 1.0)] == [0]


def test_least_loaded_baseline_ignores_alpha() -> None:
    p = policy("basic", "least_loaded")
    v = view([pe(0, 0, 500), pe(1, 1, 100), *BIG_DE], read_q={0: 0, 1: 10**9})
    assert pe_choices(p, v, 1) == [1]
