"""EventLoop: ordering by (time, priority, seq), cancellation, run limits, log digest."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.sim.events import EventLoop


def _recorder(loop: EventLoop, out: list[tuple[float, str]], name: str):
    return lambda: out.append((loop.now, name))


def test_order_is_time_then_priority_then_fifo() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, _recorder(loop, seen, "t2"))
    loop.at(1.0, _recorder(loop, seen, "t1-p0-first"))
    loop.at(1.0, _recorder(loop, seen, "t1-p-1"), priority=-1)
    loop.at(1.0, _recorder(loop, seen, "t1-p0-second"))
    loop.at(1.0, _recorder(loop, seen, "t1-p5"), priority=5)
    loop.run()
    assert [name for _, name in seen] == ["t1-p-1", "t1-p0-first", "t1-p0-second", "t1-p5", "t2"]
    assert [t for t, _ in seen] == [1.0, 1.0, 1.0, 1.0, 2.0]
    assert loop.num_processed == 5
    assert loop.now == 2.0


def test_event_scheduled_at_now_runs_in_same_instant_after_equal_keys() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []

    def first() -> None:
        seen.append((loop.now, "first"))
        loop.at(loop.now, _recorder(loop, seen, "spawned"))
        loop.after(0.0, _recorder(loop, seen, "spawned-urgent"), priority=-1)

    loop.at(1.0, first)
    loop.at(1.0, _recorder(loop, seen, "second"))
    loop.at(1.5, _recorder(loop, seen, "later"))
    loop.run()
    assert seen == [
        (1.0, "first"),
        (1.0, "spawned-urgent"),
        (1.0, "second"),
        (1.0, "spawned"),
        (1.5, "later"),
    ]


def test_cancelled_events_do_not_run_and_are_not_logged() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    keep = loop.at(1.0, _recorder(loop, seen, "keep"), label="keep")
    drop = loop.at(0.5, _recorder(loop, seen, "drop"), label="drop")
    loop.cancel(drop)
    loop.cancel(drop)  # twice: no-op
    assert not drop.is_pending and keep.is_pending
    assert loop.num_pending == 1
    loop.run()
    loop.cancel(keep)  # already processed: no-op
    assert seen == [(1.0, "keep")]
    assert loop.num_processed == 1
    assert loop.num_pending == 0
    reference = EventLoop()
    reference.at(1.0, lambda: None, label="keep")
    reference.run()
    assert loop.log_digest() == reference.log_digest()


def test_mass_cancellation_compacts_and_keeps_order() -> None:
    loop = EventLoop()
    seen: list[int] = []
    events = [loop.at(float(i), lambda i=i: seen.append(i)) for i in range(10_000)]
    for i, event in enumerate(events):
        if i % 10:
            loop.cancel(event)
    assert loop.num_pending == 1_000
    loop.run()
    assert seen == list(range(0, 10_000, 10))


def test_event_properties() -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    event = loop.at(3.0, lambda: None, priority=7, label="x")
    assert (event.time_s, event.priority, event.seq, event.label) == (3.0, 7, 1, "x")
    assert {event: "handle"}[event] == "handle"  # handles can key dicts


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_rejects_past_nan_and_infinite_times(bad: float) -> None:
    loop = EventLoop()
    with pytest.raises(ValueError, match="time_s"):
        loop.at(bad, lambda: None)
    with pytest.raises(ValueError, match="delay_s"):
        loop.after(bad, lambda: None)


def test_rejects_past_time_after_clock_moved_and_bad_priority() -> None:
    loop = EventLoop()
    loop.at(2.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="time_s"):
        loop.at(1.0, lambda: None)
    with pytest.raises(ValueError, match="priority"):
        loop.at(3.0, lambda: None, priority=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label"):
        loop.after(1.0, lambda: None, label=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="until_s"):
        loop.run(until_s=1.0)


def test_run_until_processes_inclusive_and_sets_now() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, _recorder(loop, seen, str(t)))
    loop.run(until_s=2.0)
    assert [name for _, name in seen] == ["1.0", "2.0"]
    assert loop.now == 2.0 and loop.num_pending == 1
    loop.run(until_s=2.5)
    assert loop.now == 2.5 and len(seen) == 2
    loop.run()
    assert [name for _, name in seen] == ["1.0", "2.0", "3.0"] and loop.now == 3.0


def test_stop_predicate_halts_after_the_event() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, _recorder(loop, seen, str(t)))
    loop.run(until_s=10.0, stop=lambda: len(seen) >= 2)
    assert len(seen) == 2 and loop.now == 2.0


def test_run_from_inside_a_callback_is_refused() -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: loop.run())
    with pytest.raises(RuntimeError):
        loop.run()


def _chain(loop: EventLoop, n: int, labels: tuple[str, ...]) -> None:
    state = {"i": 0}

    def step() -> None:
        i = state["i"]
        state["i"] = i + 1
        if i < n:
            loop.after(0.25 * (i % 7), step, priority=i % 3, label=labels[i % len(labels)])

    loop.at(0.0, step)


def test_digest_is_deterministic_across_log_chunks() -> None:
    n = 5_000  # crosses internal log chunk boundaries
    a, b = EventLoop(), EventLoop()
    _chain(a, n, ("x", "y"))
    _chain(b, n, ("x", "y"))
    a.run(until_s=1_000.0)
    mid = a.log_digest()
    a.run()
    b.run()
    assert a.num_processed == b.num_processed == n + 1
    assert a.log_digest() == b.log_digest() != mid
    c = EventLoop()
    _chain(c, n, ("x", "z"))
    c.run()
    assert c.log_digest() != a.log_digest()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(-2, 2), st.booleans()), min_size=1, max_size=40
    )
)
def test_processed_order_matches_sorted_keys(specs: list[tuple[int, int, bool]]) -> None:
    loop = EventLoop()
    seen: list[int] = []
    events = []
    for i, (t, prio, _) in enumerate(specs):
        events.append(loop.at(float(t), lambda i=i: seen.append(i), priority=prio))
    for event, (_, _, drop) in zip(events, specs, strict=True):
        if drop:
            loop.cancel(event)
    loop.run()
    expected = sorted(
        (i for i, (_, _, drop) in enumerate(specs) if not drop),
        key=lambda i: (specs[i][0], specs[i][1], i),
    )
    assert seen == expected
    assert loop.num_processed == len(expected)


def test_run_quiets_the_cyclic_collector_and_restores_it() -> None:
    """While events run, what existed before is frozen out of the collector and young
    collections are rarer (``GC_YOUNG``); afterwards both are as they were, also when a
    callback raises, and a caller's own freeze is left alone."""
    import gc

    from dualpath.sim import events

    seen: list[tuple[int, int]] = []

    def probe() -> None:
        seen.append((gc.get_freeze_count(), gc.get_threshold()[0]))

    before, base = gc.get_threshold(), gc.get_freeze_count()
    loop = EventLoop()
    loop.at(1.0, probe)
    loop.run()
    assert seen[0][0] > 0 and seen[0][1] == max(events.GC_YOUNG, before[0])
    assert gc.get_freeze_count() == base and gc.get_threshold() == before

    def boom() -> None:
        raise KeyError("boom")

    loop.at(2.0, boom)
    with pytest.raises(KeyError):
        loop.run()
    assert gc.get_freeze_count() == base and gc.get_threshold() == before

    gc.freeze()  # the caller's (e.g. a server before it forks): kept through the run
    try:
        mine = gc.get_freeze_count()
        loop.at(3.0, probe)
        loop.run()
        # neither unfrozen (0) nor frozen again (more): a frozen object freed meanwhile (by
        # another test's thread) leaves the permanent generation, so not an exact count
        assert 0 < seen[-1][0] <= mine and 0 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()
