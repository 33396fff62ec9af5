"""The ledger's counters, phases and incremental view (design §13.4), driven by hand."""

from __future__ import annotations

import pytest

from dualpath.ledger import (
    Aborted,
    Assigned,
    EventBus,
    FirstToken,
    Ledger,
    Phase,
    ReadDone,
    Submitted,
    Topology,
    Turn,
    TurnDone,
    decode_block_tokens,
    prompt_block_tokens,
)
from dualpath.policy import Assign
from dualpath.types import ReadSide

TOPO = Topology(2, 1, 1, True, True)  # PEs 0, 1 on node 0; DEs 2, 3 on node 1
CAPACITY = 10_000


def _ledger() -> tuple[Ledger, list[int], list[object]]:
    generated = [0, 0]
    seen: list[object] = []
    bus = EventBus()
    for kind in (Submitted, Assigned, ReadDone, FirstToken, TurnDone):
        bus.subscribe(kind, seen.append)
    ledger = Ledger(TOPO, CAPACITY, 64, bus)
    ledger.track_decode((2, 3), lambda: generated)
    return ledger, generated, seen


def test_a_turn_moves_every_counter_and_returns_them_to_zero() -> None:
    ledger, generated, seen = _ledger()
    turn = Turn(7, 0, 0, prompt_tokens=1000, hit_tokens=640, output_tokens=10, arrival_s=0.0)
    info = ledger.submit(turn, 0.0)
    assert (info.request_id, info.prompt_tokens, info.hit_tokens) == (7, 1000, 640)
    reads = ledger.assign(turn, Assign(7, 1, 3, ReadSide.DE, 0, 640), 1.0)
    assert reads == [(1, 640)] and turn.phase is Phase.SCHEDULED
    ledger.read_started(turn, 1, 1e6, 1.5)
    assert turn.phase is Phase.READING
    view = ledger.view()
    pe, de = view.engines[1], view.engines[3]
    assert (pe.seq, pe.tokens) == (1, 1000)
    assert (de.seq, de.tokens, de.free_hbm_tokens) == (1, 1000, CAPACITY - 1010)
    assert view.nodes[1].read_queue_tokens == 640 and view.nodes[1].bytes_read == 1e6
    assert ledger.read_done(turn, 1, 2.0) and turn.phase is Phase.READY
    assert turn.kv_tokens == 640
    ledger.pass_started(turn, 2.5)
    ledger.chunk_done(turn, 200, 2.7)  # a first chunk: back in the PE's queue
    assert turn.phase is Phase.READY and turn.kv_tokens == 840 and turn.new_tokens_left == 160
    ledger.pass_started(turn, 2.8)
    with pytest.raises(ValueError, match="chunk_done of its last chunk"):
        ledger.chunk_done(turn, 160, 3.0)
    ledger.first_token(turn, 3.0)
    assert turn.phase is Phase.DECODING and turn.kv_tokens == 1000
    generated[1] = 4  # the DE's decode batch produced 4 tokens for this turn so far
    view = ledger.view()
    assert (view.engines[1].seq, view.engines[1].tokens) == (0, 0)
    # tok_e of a DE: prompt + generated (design §13.4), the generated part in its group's tuple
    assert view.engines[3].tokens == 1000 and view.generated == ((0, 4),)
    assert view.engine_tokens()[3] == 1004
    assert view.nodes[1].read_queue_tokens == 0
    turn.second_token_s, turn.prefill_start_s, turn.finish_s = 3.5, 2.5, 4.0
    generated[1] = 0  # the turn left the batch
    record = ledger.finish(turn, 4.0)
    assert record.read_start_s == 1.5 and record.read_done_s == 2.0 and record.read_side == "de"
    view = ledger.view()
    assert (view.engines[3].seq, view.engines[3].tokens) == (0, 0)
    assert view.engine_tokens()[3] == 0 and view.generated == ((0, 0),)
    assert view.engines[3].free_hbm_tokens == CAPACITY
    assert [type(e).__name__ for e in seen] == [
        "Submitted",
        "Assigned",
        "ReadDone",
        "FirstToken",
        "TurnDone",
    ]
    assert turn.phase is Phase.DONE and ledger.num_done == 1


def test_nothing_to_read_is_read_at_once() -> None:
    ledger, _, _ = _ledger()
    turn = Turn(1, 0, 0, 100, 0, 1, 0.0)
    assert ledger.assign(turn, Assign(1, 0, 2, ReadSide.NONE, 0, 0), 2.0) == []
    assert turn.read_start_s == turn.read_done_s == 2.0 and turn.phase is Phase.READY


def test_a_pull_rebuilds_only_what_changed() -> None:
    ledger, generated, _ = _ledger()
    first = ledger.view()
    assert ledger.view() is first  # nothing changed: the same view
    assert first.engines[2].free_hbm_tokens == CAPACITY
    ledger.assign(Turn(1, 0, 0, 100, 0, 5, 0.0), Assign(1, 0, 2, ReadSide.NONE, 0, 0), 0.0)
    second = ledger.view()
    same = [a is b for a, b in zip(first.engines, second.engines, strict=True)]
    assert same == [False, True, False, True]
    generated[0] = 1  # a decode step: only the group's tuple is new, no engine state
    third = ledger.view()
    assert third is not second and third.engines is second.engines
    assert second.generated == ((0, 0),) and third.generated == ((1, 0),)
    assert third.engine_tokens() == [100, 0, 101, 0]


def test_track_decode_takes_whole_groups_in_engine_order() -> None:
    ledger = Ledger(TOPO, CAPACITY, 64)
    with pytest.raises(ValueError, match="not one whole DE group"):
        ledger.track_decode((3, 2), lambda: [0, 0])
    with pytest.raises(ValueError, match="not one whole DE group"):
        ledger.track_decode((2,), lambda: [0])


def test_block_rounding_persists_what_the_next_turn_hits() -> None:
    turn = Turn(1, 0, 0, prompt_tokens=200, hit_tokens=128, output_tokens=30, arrival_s=0.0)
    assert prompt_block_tokens(turn, 64) == 192 - 128
    assert decode_block_tokens(turn, 64) == 192 - 192  # 229 tokens of KV: 3 whole blocks
    turn.output_tokens = 60  # 259 tokens of KV: 4 whole blocks
    assert prompt_block_tokens(turn, 64) + decode_block_tokens(turn, 64) == 256 - 128


def test_reported_free_hbm_replaces_capacity_and_loaded_ends_the_reservation() -> None:
    """A runtime shell reports each engine's real free pool: free HBM = report − turns
    assigned and not yet admitted; once loaded, only the engine's report counts the turn."""
    ledger, _, _ = _ledger()
    ledger.report_free_hbm(3, 4000)
    ledger.report_free_hbm(1, 900)  # a PE's own pool is reported as is
    turn = Turn(1, 0, 0, prompt_tokens=500, hit_tokens=0, output_tokens=20, arrival_s=0.0)
    ledger.submit(turn, 0.0)
    ledger.assign(turn, Assign(1, 1, 3, ReadSide.NONE, 0, 0), 0.0)
    view = ledger.view()
    assert view.engines[3].free_hbm_tokens == 4000 - 520
    assert view.engines[2].free_hbm_tokens == CAPACITY  # no report: the capacity
    assert view.engines[1].free_hbm_tokens == 900
    ledger.pass_started(turn, 0.5)
    ledger.first_token(turn, 1.0)
    ledger.loaded(turn, 1.1)
    ledger.report_free_hbm(3, 3440)  # the DE now holds the turn's pages
    assert ledger.view().engines[3].free_hbm_tokens == 3440
    turn.prefill_start_s, turn.second_token_s, turn.finish_s = 0.5, 1.2, 2.0
    ledger.finish(turn, 2.0)
    ledger.report_free_hbm(3, 4000)
    view = ledger.view()
    assert (view.engines[3].seq, view.engines[3].free_hbm_tokens) == (0, 4000)
    assert ledger.reserved == [0, 0, 0, 0]


def test_abort_takes_the_turn_out_of_every_counter() -> None:
    ledger, _, _ = _ledger()
    aborted: list[object] = []
    ledger.events.subscribe(Aborted, aborted.append)
    reading = Turn(1, 0, 0, prompt_tokens=1000, hit_tokens=640, output_tokens=10, arrival_s=0.0)
    decoding = Turn(2, 1, 0, prompt_tokens=300, hit_tokens=0, output_tokens=10, arrival_s=0.0)
    for t in (reading, decoding):
        ledger.submit(t, 0.0)
    ledger.assign(reading, Assign(1, 0, 2, ReadSide.PE, 640, 0), 1.0)
    ledger.assign(decoding, Assign(2, 1, 2, ReadSide.NONE, 0, 0), 1.0)
    ledger.pass_started(decoding, 1.5)
    ledger.first_token(decoding, 2.0)
    view = ledger.view()
    assert view.nodes[0].read_queue_tokens == 640 and view.engines[2].seq == 2
    ledger.abort(reading, 3.0)
    ledger.abort(decoding, 3.0)
    assert reading.phase is Phase.ABORTED and len(aborted) == 2
    view = ledger.view()
    assert view.nodes[0].read_queue_tokens == 0
    assert [(e.seq, e.tokens) for e in view.engines] == [(0, 0)] * 4
    assert view.engines[2].free_hbm_tokens == CAPACITY
    with pytest.raises(ValueError, match="abort while aborted"):
        ledger.abort(reading, 4.0)


def test_journal_replays_to_the_same_decisions() -> None:
    from dualpath.config import preset
    from dualpath.ledger import ReplayMismatch, replay
    from dualpath.policy import make_policy

    cfg = preset("tiny-1p1d")
    topo = Topology.from_config(cfg)
    policy = make_policy(cfg)
    ledger = Ledger(topo, CAPACITY, cfg.scheduler.block_tokens)
    records: list[dict[str, object]] = []
    ledger.start_journal(records.append)
    turn = Turn(0, 0, 0, prompt_tokens=100, hit_tokens=0, output_tokens=5, arrival_s=0.0)
    policy.submit(ledger.submit(turn, 0.0), 0.0)
    (a,) = ledger.pull(policy, 0.0)
    ledger.assign(turn, a, 0.0)
    stats = replay(list(records), topo, make_policy(cfg))
    assert (stats.pulls, stats.assignments) == (1, 1)
    records[-1]["a"] = [0, a.pe, a.de, "de", 0, 0]  # carried out other than decided
    with pytest.raises(ReplayMismatch, match="not the next decision"):
        replay(records, topo, make_policy(cfg))
