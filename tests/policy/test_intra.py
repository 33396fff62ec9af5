"""Intra-engine scheduling (design §7.2): FIFO packing under the compute quota, chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_testkit import linear_predict, policy

from dualpath.policy import PendingPrefill, pack_forward

P = PendingPrefill


def plan(queue: list[PendingPrefill], quota: float | None, budget: int | None = None):  # type: ignore[no-untyped-def]
    return pack_forward(7, queue, linear_predict, quota, budget)


def test_packs_fifo_then_chunks_overflowing_request() -> None:
    # cost units (c + b/2)·b: A 5e7, B 2e8; C whole would add 2e8 > the 6e7 left of 3.1e8
    b = plan([P(1, 0, 10_000), P(2, 0, 20_000), P(3, 0, 20_000), P(4, 0, 10)], 0.31)
    assert [(c.request_id, c.cached, c.new, c.is_last) for c in b.chunks] == [
        (1, 0, 10_000, True),
        (2, 0, 20_000, True),
        (3, 0, 10_954, False),  # largest b with b²/2 ≤ 6e7; request 4 stays queued
    ]
    assert b.engine_id == 7
    assert b.predicted_attention_s <= 0.31
    assert b.predicted_attention_s == pytest.approx(
        linear_predict([(0, 10_000), (0, 20_000), (0, 10_954)])
    )


def test_cached_tokens_count_in_prediction() -> None:
    # (1e5 + b/2)·b ≤ 1e8 ⇒ b = 990 (990·100495 = 99,490,050; 991 → 99,590,904... ≤ 1e8)
    b = plan([P(1, 100_000, 5000)], 0.1)
    (c,) = b.chunks
    assert c.cached == 100_000 and not c.is_last
    assert linear_predict([(100_000, c.new)]) <= 0.1 < linear_predict([(100_000, c.new + 1)])


def test_forced_progress_when_one_token_exceeds_quota() -> None:
    # (1e9 + 1/2)·1 > 3e8: no chunk meets the quota, so the head runs alone and whole (one
    # pass), not one token per pass for 100 passes
    b = plan([P(1, 10**9, 100), P(2, 0, 10)], 0.3)
    assert [(c.request_id, c.new, c.is_last) for c in b.chunks] == [(1, 100, True)]
    assert b.predicted_attention_s == pytest.approx(linear_predict([(10**9, 100)]))


def test_head_larger_than_the_kv_budget_is_refused_not_advanced_token_by_token() -> None:
    # 3500 cached + 1000 new > 4000: its last chunk would hold 4500 tokens of KV; before the
    # fix it advanced 500 tokens, then one token per pass past the budget
    with pytest.raises(ValueError, match=r"request 1: cached \+ new = 3500 \+ 1000 tokens"):
        plan([P(1, 3500, 1000)], None, budget=4000)
    with pytest.raises(ValueError, match="kv_budget_tokens=4000"):
        plan([P(1, 4000, 1), P(2, 0, 5)], 0.3, budget=4000)
    # exactly the budget fits whole; a later request that alone would not fit is chunked
    # here and refused only when it reaches the head
    b = plan([P(1, 3000, 1000), P(2, 5000, 10)], None, budget=4000)
    assert [(c.request_id, c.new, c.is_last) for c in b.chunks] == [(1, 1000, True)]


def test_no_quota_takes_whole_queue() -> None:
    b = plan([P(1, 0, 10**6), P(2, 5, 10**6)], None)
    assert [c.new for c in b.chunks] == [10**6, 10**6]


def test_kv_budget_caps_resident_tokens() -> None:
    # budget 4000: A resident 1500; B may add only 4000 − 1500 − 2000 = 500 new tokens
    b = plan([P(1, 1000, 500), P(2, 2000, 1000), P(3, 0, 5)], None, budget=4000)
    assert [(c.request_id, c.new, c.is_last) for c in b.chunks] == [(1, 500, True), (2, 500, False)]
    assert sum(c.cached + c.new for c in b.chunks) <= 4000


def test_zero_new_tokens_finish_immediately() -> None:
    b = plan([P(1, 640, 0), P(2, 0, 10)], 0.3)
    assert [(c.request_id, c.new, c.is_last) for c in b.chunks] == [(1, 0, True), (2, 10, True)]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="cached=-1"):
        P(1, -1, 5)
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        plan([P(1, 0, 5)], 0.3, budget=-5)


def test_baselines_have_no_quota_dualpath_has() -> None:
    q = [P(1, 0, 10**6)]
    assert policy("basic").plan_forward(0, q, 0.0).chunks[0].new == 10**6
    assert policy("dpl").plan_forward(0, q, 0.0).chunks[0].new == 10**6
    assert policy("dualpath", compute_quota_s=0.3).plan_forward(0, q, 0.0).chunks[0].new < 10**6


def test_group_plan_reports_per_gpu_and_bubble() -> None:
    p = policy("dualpath", compute_quota_s=10.0)
    g = p.plan_group({3: [P(1, 0, 2000)], 1: [P(2, 0, 1000)], 2: []}, 0.0)
    assert [b.engine_id for b in g.batches] == [1, 2, 3]
    t1, t3 = linear_predict([(0, 1000)]), linear_predict([(0, 2000)])
    assert g.per_gpu_s == pytest.approx((t1, 0.0, t3))
    assert g.max_s == pytest.approx(t3)
    assert g.bubble_ratio == pytest.approx(t3 / ((t1 + t3) / 3))
    assert g.bubble_s == pytest.approx((t3 - t1) + t3)


items = st.lists(st.tuples(st.integers(0, 200_000), st.integers(0, 20_000)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(items, st.floats(0.02, 2.0), st.one_of(st.none(), st.integers(202_000, 600_000)))
def test_chunks_fit_quota_and_sum_to_requests(raw, quota: float, budget: int | None) -> None:  # type: ignore[no-untyped-def]
    """Plan passes until the queue is empty: each pass fits the quota (or is one forced
    chunk), packs a FIFO prefix, and every request's chunks sum to its new tokens."""
    if budget is not None:  # a request larger than the budget is refused (its own test)
        raw = [(min(c, budget // 2), min(n, budget // 2)) for c, n in raw]
    queue = [P(i, c, n) for i, (c, n) in enumerate(raw)]
    done: dict[int, int] = {}
    for _ in range(100_000):
        if not queue:
            break
        b = plan(queue, quota, budget)
        assert b.chunks, "no progress"
        forced = len(b.chunks) == 1 and b.chunks[0].is_last
        assert b.predicted_attention_s <= quota or forced
        if budget is not None:
            assert sum(c.cached + c.new for c in b.chunks) <= budget
        assert [c.request_id for c in b.chunks] == [q.request_id for q in queue[: len(b.chunks)]]
        assert all(c.is_last for c in b.chunks[:-1])
        for c in b.chunks:
            done[c.request_id] = done.get(c.request_id, 0) + c.new
        last = b.chunks[-1]
        queue = queue[len(b.chunks) :]
        if not last.is_last:
            head = raw[last.request_id]
            queue.insert(
                0, P(last.request_id, last.cached + last.new, head[1] - done[last.request_id])
            )
    assert not queue
    assert done == {i: n for i, (_, n) in enumerate(raw)}


def test_median_cap_is_the_median_of_the_busy_gpus_at_least_the_floor() -> None:
    from dualpath.policy.intra import median_cap

    assert median_cap([0.0, 0.1, 0.02, 0.05], 0.0) == 0.05  # busy: 0.02, 0.05, 0.1
    assert median_cap([0.0, 0.1, 0.02, 0.05, 0.3], 0.0) == 0.05  # even count: the lower one
    assert median_cap([0.3, 0.1], 0.0) == 0.1  # of two: the shorter
    assert median_cap([0.0, 0.1, 0.02, 0.05], 0.08) == 0.08  # never below the floor
    assert median_cap([0.0, 0.4, 0.0], 0.0) is None  # one busy GPU: nothing to balance
    assert median_cap([], 0.0) is None


def test_median_balance_chunks_the_busiest_gpus_to_the_median() -> None:
    # linear_predict: (0, 40k) = 0.8 s, (0, 10k) = 0.05 s, (0, 20k) = 0.2 s; quota 1 s
    queues = {0: [P(1, 0, 40_000)], 1: [P(2, 0, 10_000)], 2: [P(3, 0, 20_000)], 3: []}
    quota = policy("dualpath", compute_quota_s=1.0).plan_group(queues, 0.0)
    assert quota.per_gpu_s == pytest.approx((0.8, 0.05, 0.2, 0.0))
    even = policy("dualpath", compute_quota_s=1.0, pass_balance="median").plan_group(queues, 0.0)
    # cap = the median of 0.05, 0.2, 0.8 = 0.2: request 1 runs its first 20,000 tokens
    # (b²/2 · 1e-9 ≤ 0.2), the others whole
    got = [[(c.request_id, c.cached, c.new, c.is_last) for c in b.chunks] for b in even.batches]
    assert got == [[(1, 0, 20_000, False)], [(2, 0, 10_000, True)], [(3, 0, 20_000, True)], []]
    assert even.per_gpu_s == pytest.approx((0.2, 0.05, 0.2, 0.0))
    assert even.bubble_ratio < quota.bubble_ratio
    floored = policy(
        "dualpath", compute_quota_s=1.0, pass_balance="median", balance_floor_s=0.5
    ).plan_group(queues, 0.0)
    assert floored.batches[0].chunks[0].new == 31_622  # largest b with b²/2 ≤ 5e8
    assert floored.batches[2].chunks[0].new == 20_000  # below the cap: unchanged


def test_baselines_do_not_balance_passes() -> None:
    queues = {0: [P(1, 0, 40_000)], 1: [P(2, 0, 10_000)]}
    g = policy("dpl", pass_balance="median").plan_group(queues, 0.0)
    assert [b.chunks[0].new for b in g.batches] == [40_000, 10_000]


def test_pass_balance_must_be_known() -> None:
    from dualpath.config import apply_overrides, preset

    with pytest.raises(ValueError, match="pass_balance"):
        policy("dualpath", pass_balance="mean")
    with pytest.raises(ValueError, match=r"scheduler\.pass_balance"):
        apply_overrides(preset("tiny-1p1d"), ["scheduler.pass_balance=even"])
