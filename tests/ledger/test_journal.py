"""The journal: a subscriber on the ledger's event bus that writes every input and decision
as one record; the format is fixed (``ledger.replay`` and the two-shells test read it)."""

from __future__ import annotations

from typing import Any

import pytest

from dualpath.config import preset
from dualpath.ledger import (
    ChunkDone,
    EventBus,
    FreeHbmReported,
    GeneratedCounted,
    Journal,
    Ledger,
    Loaded,
    NodeReadDone,
    PassStarted,
    Planned,
    Pulled,
    ReadStarted,
    Submitted,
    Topology,
    Turn,
    replay,
)
from dualpath.policy import make_policy
from dualpath.policy.base import PendingPrefill

# what the ledger wrote before its journal became a subscriber (its twelve ``if
# self.journal`` blocks), for the run ``_drive`` makes: every op once or more
EXPECTED: list[dict[str, Any]] = [
    {
        "op": "init",
        "hbm_capacity_tokens": 10000,
        "block_tokens": 64,
        "decode_groups": [[2, 3]],
        "free_hbm": [-1, -1, 9000, -1],
    },
    {
        "op": "submit",
        "t": 0.0,
        "id": 0,
        "agent": 0,
        "turn": 0,
        "prompt": 300,
        "hit": 128,
        "output": 5,
        "arrival": 0.0,
    },
    {
        "op": "submit",
        "t": 0.5,
        "id": 1,
        "agent": 1,
        "turn": 0,
        "prompt": 100,
        "hit": 0,
        "output": 3,
        "arrival": 0.5,
    },
    {
        "op": "pull",
        "t": 1.0,
        "view": {
            "engines": [[0, 0, 0], [0, 0, 0], [0, 0, 9000], [0, 0, 10000]],
            "nodes": [[0, 0.0], [0, 0.0]],
        },
        "assigns": [[0, 0, 2, "pe", 128, 0], [1, 1, 3, "none", 0, 0]],
    },
    {"op": "assign", "t": 1.0, "a": [0, 0, 2, "pe", 128, 0], "read": True},
    {"op": "read_started", "t": 1.1, "id": 0, "node": 0, "bytes": 1280.0},
    {"op": "read_done", "t": 1.5, "id": 0, "node": 0},
    {"op": "assign", "t": 1.0, "a": [1, 1, 3, "none", 0, 0], "read": True},
    {
        "op": "plan",
        "t": 1.6,
        "pe": 0,
        "budget": 5000,
        "pending": [[0, 128, 172], [1, 0, 100]],
        "chunks": [[0, 128, 172, True], [1, 0, 100, True]],
    },
    {
        "op": "plan",
        "t": 1.6,
        "pe": 0,
        "budget": None,
        "pending": [[0, 128, 172]],
        "chunks": [[0, 128, 172, True]],
        "cap": 0.25,
    },
    {"op": "pass_started", "t": 1.7, "id": 0},
    {"op": "first_token", "t": 2.0, "id": 0},
    {"op": "free_hbm", "engine": 2, "tokens": 8000},
    {"op": "loaded", "t": 2.1, "id": 0},
    {"op": "generated", "members": [2, 3], "values": [3, 0]},
    {"op": "finish", "t": 3.0, "id": 0, "times": [1.7, 2.2, 3.0], "hit": 128},
    {"op": "abort", "t": 3.5, "id": 1},
]


def _drive(ledger: Ledger, topo: Topology, records: list[dict[str, Any]]) -> None:
    cfg = preset("tiny-1p1d")
    policy = make_policy(cfg)
    des = list(topo.de_ids)
    generated = [0] * len(des)
    ledger.track_decode(tuple(des), lambda: generated)
    ledger.report_free_hbm(des[0], 9000)
    ledger.start_journal(records.append)
    t0 = Turn(0, 0, 0, prompt_tokens=300, hit_tokens=128, output_tokens=5, arrival_s=0.0)
    t1 = Turn(1, 1, 0, prompt_tokens=100, hit_tokens=0, output_tokens=3, arrival_s=0.5)
    policy.submit(ledger.submit(t0, 0.0), 0.0)
    policy.submit(ledger.submit(t1, 0.5), 0.5)
    assigns = ledger.pull(policy, 1.0)
    turns = {0: t0, 1: t1}
    for a in assigns:
        for node, tokens in ledger.assign(turns[a.request_id], a, 1.0):
            ledger.read_started(turns[a.request_id], node, tokens * 10.0, 1.1)
            ledger.read_done(turns[a.request_id], node, 1.5)
    pe = assigns[0].pe
    ledger.plan(policy, pe, [PendingPrefill(0, 128, 172), PendingPrefill(1, 0, 100)], 1.6, 5000)
    ledger.plan(policy, pe, [PendingPrefill(0, 128, 172)], 1.6, None, 0.25)
    ledger.pass_started(t0, 1.7)
    ledger.first_token(t0, 2.0)
    ledger.report_free_hbm(des[0], 8000)
    ledger.loaded(t0, 2.1)
    generated[0] = 3
    ledger.view()
    t0.prefill_start_s, t0.second_token_s, t0.finish_s = 1.7, 2.2, 3.0
    ledger.finish(t0, 3.0)
    ledger.abort(t1, 3.5)


def test_the_journal_writes_the_records_it_always_wrote() -> None:
    topo = Topology.from_config(preset("tiny-1p1d"))
    records: list[dict[str, Any]] = []
    _drive(Ledger(topo, 10_000, 64), topo, records)
    assert records == EXPECTED
    # and it still replays (the pull, both assignments and both plans)
    stats = replay(records, topo, make_policy(preset("tiny-1p1d")))
    assert (stats.pulls, stats.assignments, stats.plans) == (1, 2, 2)


def test_the_ledger_emits_journal_events_only_to_subscribers() -> None:
    """Without a journal nobody wants the ledger's input events (so none is built); with
    one, the journal is a subscriber like any other, beside the shell's own."""
    topo = Topology.from_config(preset("tiny-1p1d"))
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(Submitted, seen.append)
    ledger = Ledger(topo, 10_000, 64, bus)
    journal_kinds = (
        ReadStarted,
        NodeReadDone,
        PassStarted,
        ChunkDone,
        Loaded,
        FreeHbmReported,
        GeneratedCounted,
        Pulled,
        Planned,
    )
    assert not any(bus.wants(k) for k in journal_kinds)
    records: list[dict[str, Any]] = []
    _drive(ledger, topo, records)
    assert all(bus.wants(k) for k in journal_kinds)
    assert isinstance(ledger.journal, Journal)
    assert [type(e) for e in seen] == [Submitted, Submitted]  # the shell's subscriber too
    assert [r["op"] for r in records if r["op"] == "submit"] == ["submit", "submit"]
    with pytest.raises(ValueError, match="already writes a journal"):
        ledger.start_journal(records.append)
