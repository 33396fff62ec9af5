"""The ledger's journal: a subscriber on its event bus that writes every input the ledger
was given (turn events, engine reports) and every decision it carried (each pull's view and
assignments, each forward plan) as one JSON-able record, for ``ledger.replay``.

Records only (an observer changes nothing); the ``init`` record, which holds the
ledger's sizes, is written by ``Ledger.start_journal`` before this subscribes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dualpath.ledger.events import (
    Aborted,
    Assigned,
    ChunkDone,
    EventBus,
    FirstToken,
    FreeHbmReported,
    GeneratedCounted,
    Loaded,
    NodeReadDone,
    PassStarted,
    Planned,
    Pulled,
    ReadStarted,
    Submitted,
    TurnDone,
)
from dualpath.policy import Assign, ClusterView

# takes one journal record (a dict of JSON types)
JournalSink = Callable[[dict[str, Any]], None]


def encode_view(view: ClusterView) -> dict[str, list[list[float]]]:
    """A view as journal data: ``[seq, tok_e, free HBM]`` per engine (tok_e whole: generated
    tokens included), ``[read_q, bytes read]`` per node (ids, kinds and groups are the
    topology's)."""
    tokens = view.engine_tokens()
    return {
        "engines": [
            [e.seq, t, e.free_hbm_tokens] for e, t in zip(view.engines, tokens, strict=True)
        ],
        "nodes": [[n.read_queue_tokens, n.bytes_read] for n in view.nodes],
    }


def encode_assign(a: Assign) -> list[Any]:
    return [a.request_id, a.pe, a.de, a.read_side.value, a.pe_read_tokens, a.de_read_tokens]


class Journal:
    """Writes one record to ``sink`` per journalled event, in the order the bus emits them
    (the order the ledger was given its inputs)."""

    def __init__(self, sink: JournalSink) -> None:
        self.sink = sink

    def subscribe(self, events: EventBus) -> None:
        on = events.subscribe
        on(Submitted, self.on_submitted)
        on(Pulled, self.on_pulled)
        on(Planned, self.on_planned)
        on(Assigned, self.on_assigned)
        on(ReadStarted, self.on_read_started)
        on(NodeReadDone, self.on_node_read_done)
        on(PassStarted, self.on_pass_started)
        on(ChunkDone, self.on_chunk_done)
        on(FirstToken, self.on_first_token)
        on(Loaded, self.on_loaded)
        on(TurnDone, self.on_turn_done)
        on(Aborted, self.on_aborted)
        on(FreeHbmReported, self.on_free_hbm_reported)
        on(GeneratedCounted, self.on_generated_counted)

    def on_submitted(self, ev: Submitted) -> None:
        turn = ev.turn
        self.sink(
            {
                "op": "submit",
                "t": ev.now,
                "id": turn.request_id,
                "agent": turn.agent_id,
                "turn": turn.turn_index,
                "prompt": turn.prompt_tokens,
                "hit": turn.hit_tokens,
                "output": turn.output_tokens,
                "arrival": turn.arrival_s,
            }
        )

    def on_pulled(self, ev: Pulled) -> None:
        self.sink(
            {
                "op": "pull",
                "t": ev.now,
                "view": encode_view(ev.view),
                "assigns": [encode_assign(a) for a in ev.assigns],
            }
        )

    def on_planned(self, ev: Planned) -> None:
        rec: dict[str, Any] = {
            "op": "plan",
            "t": ev.now,
            "pe": ev.pe,
            "budget": ev.budget,
            "pending": [[p.request_id, p.cached, p.new] for p in ev.pending],
            "chunks": [[c.request_id, c.cached, c.new, c.is_last] for c in ev.batch.chunks],
        }
        if ev.cap_s is not None:
            rec["cap"] = ev.cap_s
        self.sink(rec)

    def on_assigned(self, ev: Assigned) -> None:
        self.sink({"op": "assign", "t": ev.now, "a": encode_assign(ev.assign), "read": ev.read})

    def on_read_started(self, ev: ReadStarted) -> None:
        self.sink(
            {
                "op": "read_started",
                "t": ev.now,
                "id": ev.turn.request_id,
                "node": ev.node,
                "bytes": ev.num_bytes,
            }
        )

    def on_node_read_done(self, ev: NodeReadDone) -> None:
        self.sink({"op": "read_done", "t": ev.now, "id": ev.turn.request_id, "node": ev.node})

    def on_pass_started(self, ev: PassStarted) -> None:
        self.sink({"op": "pass_started", "t": ev.now, "id": ev.turn.request_id})

    def on_chunk_done(self, ev: ChunkDone) -> None:
        self.sink({"op": "chunk_done", "t": ev.now, "id": ev.turn.request_id, "new": ev.new_tokens})

    def on_first_token(self, ev: FirstToken) -> None:
        self.sink({"op": "first_token", "t": ev.now, "id": ev.turn.request_id})

    def on_loaded(self, ev: Loaded) -> None:
        self.sink({"op": "loaded", "t": ev.now, "id": ev.turn.request_id})

    def on_turn_done(self, ev: TurnDone) -> None:
        turn = ev.turn
        self.sink(
            {
                "op": "finish",
                "t": ev.now,
                "id": turn.request_id,
                "times": [turn.prefill_start_s, turn.second_token_s, turn.finish_s],
                "hit": turn.hit_tokens,
            }
        )

    def on_aborted(self, ev: Aborted) -> None:
        self.sink({"op": "abort", "t": ev.now, "id": ev.turn.request_id})

    def on_free_hbm_reported(self, ev: FreeHbmReported) -> None:
        self.sink({"op": "free_hbm", "engine": ev.engine, "tokens": ev.tokens})

    def on_generated_counted(self, ev: GeneratedCounted) -> None:
        self.sink({"op": "generated", "members": list(ev.members), "values": list(ev.values)})
