"""DE assignment (design §7.1): phase 1 across groups, phase 2 prefix R, Z, normal / high-token."""

from __future__ import annotations

import pytest
from policy_testkit import de, pe, policy, req, view

PES = [pe(0, 0)]  # one PE with β = 10,000; requests of prompt 100 + output 10 ⇒ len_r = 110


def run(des, n: int = 1, **kw):  # type: ignore[no-untyped-def]
    p = policy(record_decisions=True, beta_tokens=10**9, **kw)
    for i in range(n):
        p.submit(req(i), 0.0)
    out = p.schedule(view(PES + des), 0.0)
    return p, out, [d for d in p.decisions() if d["kind"] in ("de", "de_wait")]


def test_normal_smallest_seq_then_tok() -> None:
    # R = 10 × 110, Σ tok = 105 ⇒ Z = 1.05 · 1205 / 3 = 421.75: all three are normal
    des = [de(10, 1, 10**6, tok=30, seq=3), de(11, 1, 10**6, 40, 1), de(12, 1, 10**6, 35, 1)]
    _, out, recs = run(des, n=10)
    first = recs[0]
    assert first["z_tokens"] == pytest.approx(1.05 * (1100 + 105) / 3)
    assert first["num_prefix_r"] == 10
    assert (first["decision"], first["chosen"]) == ("normal", 12)  # seq tie → smaller tok
    assert first["runners_up"][0]["engine"] == 11
    assert out[0].de == 12


def test_high_token_smallest_tok_ignores_seq() -> None:
    # z_factor 1: Z = (110 + 2850) / 3 ≈ 986.7; every DE has tok + 110 > Z ⇒ high-token
    des = [de(10, 1, 10**6, 1000, 1), de(11, 1, 10**6, 900, 5), de(12, 1, 10**6, 950, 2)]
    _, out, recs = run(des, z_factor=1.0)
    assert recs[0]["decision"] == "high_token"
    assert recs[0]["num_normal"] == 0 and recs[0]["num_high_token"] == 3
    assert out[0].de == 11


def test_boundary_tok_plus_len_equal_z_is_normal() -> None:
    # one DE: Z = 1.0 · (110 + 0) / 1 = 110 = tok + len ⇒ normal
    _, out, recs = run([de(10, 1, 1000)], z_factor=1.0)
    assert recs[0]["decision"] == "normal"
    assert out[0].de == 10


def test_no_room_skipped_even_if_smallest_seq() -> None:
    des = [de(10, 1, free=109), de(11, 1, 10**6, tok=50, seq=4)]
    _, out, recs = run(des, n=1)
    assert out[0].de == 11
    assert recs[0]["num_no_room"] == 1


def test_hbm_used_within_round() -> None:
    # each DE fits exactly one request of 110 tokens; the third waits
    p, out, recs = run([de(10, 1, 110), de(11, 1, 150)], n=3)
    assert sorted(a.de for a in out) == [10, 11]
    assert recs[-1]["kind"] == "de_wait" and recs[-1]["request"] == 2
    assert p.num_waiting == 1 and p.num_holding_pe == 1


def test_prefix_r_limited_by_total_free_hbm() -> None:
    # total free 250 ⇒ R holds 2 requests (220 ≤ 250 < 330); Z = 1.05 · 220 / 2
    _, _, recs = run([de(10, 1, 125), de(11, 1, 125)], n=5)
    assert recs[0]["num_prefix_r"] == 2
    assert recs[0]["z_tokens"] == pytest.approx(1.05 * 220 / 2)


def test_waiting_request_assigned_when_room_appears() -> None:
    p = policy()
    p.submit(req(0), 0.0)
    assert p.schedule(view([*PES, de(10, 1, 50)]), 0.0) == []
    out = p.schedule(view([*PES, de(10, 1, 500)]), 1.0)
    assert [(a.request_id, a.pe, a.de) for a in out] == [(0, 0, 10)]


def test_phase1_smallest_group_load_with_private_queue() -> None:
    # group 0 Σ tok = 1000, group 1 Σ tok = 900: request 0 → group 1 (load → 1010),
    # request 1 → group 0 (1000 < 1010), request 2 → group 0? 1110 vs 1010 → group 1
    des = [de(10, 1, 10**6, 1000, 1, group=0), de(20, 2, 10**6, 900, 1, group=1)]
    p, out, _ = run(des, n=3)
    groups = [r["chosen_group"] for r in p.decisions() if r["kind"] == "de_group"]
    assert groups == [1, 0, 1]
    assert {a.request_id: a.de for a in out} == {0: 20, 1: 10, 2: 20}


def test_phase1_tie_lowest_group_id() -> None:
    des = [de(10, 1, 10**6, group=5), de(20, 2, 10**6, group=3)]
    _, out, _ = run(des, n=1)
    assert out[0].de == 20


def test_private_queue_blocks_only_its_group() -> None:
    # request 0 (len 110) lands in group 1 (lower load) where it does not fit: it waits
    # there; request 1 goes to group 0 (its load is now lower) and is assigned.
    des = [de(10, 1, 10**6, 100, 1, group=0), de(20, 2, 50, group=1)]
    p, out, _ = run(des, n=2)
    assert [(a.request_id, a.de) for a in out] == [(1, 10)]
    assert p.num_waiting == 1


def test_basic_round_robin_de_with_room() -> None:
    p = policy("basic")
    for i in range(4):
        p.submit(req(i), 0.0)
    out = p.schedule(view([*PES, de(10, 1, 10**6), de(11, 1, 100), de(12, 1, 10**6)]), 0.0)
    assert [a.de for a in out] == [10, 12, 10, 12]  # DE 11 (free 100 < 110) skipped


def test_basic_least_loaded_de() -> None:
    p = policy("basic", "least_loaded")
    p.submit(req(0), 0.0)
    out = p.schedule(view([*PES, de(10, 1, 10**6, 500, 1), de(11, 1, 10**6, 400, 9)]), 0.0)
    assert out[0].de == 11
