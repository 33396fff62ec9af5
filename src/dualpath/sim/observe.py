"""Read-only observation of a running ``Cluster`` through its events: spans, per-forward
attention, SNIC bytes.

An ``Observer`` subscribes to the cluster's ``EventBus`` before the run starts and records
Chrome-trace spans (every transfer that takes time, each forward pass per PE, decode
intervals per DE, and per finished turn its phases on its agent's track), each forward's
attention time per GPU of the EP group (the same ``cost.attention_time_s`` the prefill group
charges) and cumulative SNIC read bytes per node sampled by the driver. Spans that serve
known requests carry their ids (``request_id``: a turn's phases and its storage read;
``request_ids``: a forward pass's chunks, a decode interval's resident requests), so one turn
can be followed across nodes by searching its id. It changes no timing and no decision: a
run with and without an observer has the same event-log digest (tested).
"""

from __future__ import annotations

from dualpath.ledger import (
    DecodeStepsDone,
    FirstToken,
    ForwardDone,
    ForwardStarted,
    NodeReadDone,
    Planned,
    ReadStarted,
    TransferDone,
    TurnDone,
)
from dualpath.metrics.chrome_trace import Span
from dualpath.models import cost
from dualpath.sim.cluster import Cluster


class Observer:
    """Attach with ``Observer(cluster, spans=True)`` before running the cluster's loop."""

    def __init__(self, cluster: Cluster, spans: bool = False) -> None:
        self.cluster = cluster
        self.record_spans = spans
        self.spans: list[Span] = []
        self.attention: list[tuple[float, list[float]]] = []  # (pass start s, s per GPU)
        self.snic_samples: list[tuple[float, list[float]]] = []  # (time s, cumulative bytes)
        self._names = self._resource_names()
        self._planned: dict[int, tuple[int, ...]] = {}  # PE → request ids of its next pass
        self._resident: dict[int, set[int]] = {}  # DE → request ids past the first token
        self._reads: dict[tuple[int, int], tuple[float, float]] = {}  # (request, node) → start
        events = cluster.events
        events.subscribe(ForwardStarted, self._on_forward_started)
        if spans:
            events.subscribe(Planned, self._on_planned)
            events.subscribe(ForwardDone, self._on_forward_done)
            events.subscribe(TransferDone, self._on_transfer_done)
            events.subscribe(DecodeStepsDone, self._on_decode_steps)
            events.subscribe(ReadStarted, self._on_read_started)
            events.subscribe(NodeReadDone, self._on_node_read_done)
            events.subscribe(FirstToken, self._on_first_token)
            events.subscribe(TurnDone, self._on_turn_done)

    # ------------------------------------------------------------------ samples
    def sample_snic(self) -> None:
        """Append (now, cumulative SNIC read bytes per node) — call at regular times."""
        c = self.cluster
        carried = [c.net.bytes_carried(c.fabric.snic_read[n]) for n in range(c.topo.num_nodes)]
        self.snic_samples.append((c.loop.now, carried))

    # ------------------------------------------------------------------ subscriptions
    def _on_forward_started(self, ev: ForwardStarted) -> None:
        if len(ev.members) < 2:
            return
        model, hw = self.cluster.config.model, self.cluster.config.hardware
        per_gpu = dict.fromkeys(ev.members, 0.0)
        for pe, chunks in ev.batches:
            per_gpu[pe] = cost.attention_time_s(model, hw, list(chunks))
        self.attention.append((ev.now, [per_gpu[pe] for pe in ev.members]))

    def _on_planned(self, ev: Planned) -> None:
        # the last plan of a PE before its pass starts is the pass (a re-plan replaces it)
        self._planned[ev.pe] = tuple(c.request_id for c in ev.batch.chunks)

    def _on_forward_done(self, ev: ForwardDone) -> None:
        topo = self.cluster.topo
        for pe, chunks in sorted(ev.batches):
            args = {
                "new_tokens": sum(new for _, new in chunks),
                "request_ids": list(self._planned.get(pe, ())),
            }
            track = f"node{topo.node_of(pe)}"
            self.spans.append(Span(f"pe{pe} forward", "prefill", ev.start_s, ev.now, args, track))

    def _on_read_started(self, ev: ReadStarted) -> None:
        self._reads[(ev.turn.request_id, ev.node)] = (ev.now, ev.num_bytes)

    def _on_node_read_done(self, ev: NodeReadDone) -> None:
        start_s, num_bytes = self._reads.pop((ev.turn.request_id, ev.node), (ev.now, 0.0))
        if ev.now > start_s:
            args = {
                "request_id": ev.turn.request_id,
                "agent_id": ev.turn.agent_id,
                "bytes": num_bytes,
            }
            node = f"node{ev.node}"
            name = f"r{ev.turn.request_id} read"
            self.spans.append(Span(f"{node} reads", name, start_s, ev.now, args, node, "read"))

    def _on_first_token(self, ev: FirstToken) -> None:
        # from its first token to its last, a turn is its DE's (H2D, then decode steps)
        self._resident.setdefault(ev.turn.de, set()).add(ev.turn.request_id)

    def _on_turn_done(self, ev: TurnDone) -> None:
        t, r = ev.turn, ev.record
        self._resident.get(t.de, set()).discard(t.request_id)
        args = {
            "request_id": t.request_id,
            "agent_id": t.agent_id,
            "turn_index": t.turn_index,
            "pe": t.pe,
            "de": t.de,
            "read_side": r.read_side,
            "prompt_tokens": r.prompt_tokens,
            "hit_tokens": r.hit_tokens,
            "output_tokens": r.output_tokens,
        }
        track, name = f"agent{t.agent_id}", f"r{t.request_id} t{t.turn_index}"
        phases = (
            ("queue", r.arrival_s, r.scheduled_s),
            (f"read ({r.read_side})", r.read_start_s, r.read_done_s),
            ("wait", r.read_done_s, r.prefill_start_s),
            (f"prefill pe{t.pe}", r.prefill_start_s, r.first_token_s),
            (f"decode de{t.de}", r.first_token_s, r.finish_s),
        )
        for phase, start_s, end_s in phases:
            if end_s > start_s:
                span = Span(track, f"{name} {phase}", start_s, end_s, args, "agents", "turn")
                self.spans.append(span)

    def _on_transfer_done(self, ev: TransferDone) -> None:
        if ev.now <= ev.start_s:
            return
        names = self._names
        track = names.get(ev.path[0], f"res{ev.path[0]}") if ev.path else "none"
        args = {"bytes": ev.size_bytes, "path": [names.get(r, str(r)) for r in ev.path]}
        node = track.split(" ", 1)[0]
        self.spans.append(Span(f"{track} {ev.kind}", ev.kind, ev.start_s, ev.now, args, node))

    def _on_decode_steps(self, ev: DecodeStepsDone) -> None:
        topo = self.cluster.topo
        for de, batch in zip(ev.members, ev.batch, strict=True):
            if batch:
                ids = sorted(self._resident.get(de, ()))
                args = {"steps": ev.steps, "batch": batch, "request_ids": ids}
                track = f"node{topo.node_of(de)}"
                self.spans.append(Span(f"de{de} decode", "decode", ev.start_s, ev.now, args, track))

    def _resource_names(self) -> dict[int, str]:
        topo, fabric = self.cluster.topo, self.cluster.fabric
        names: dict[int, str] = {}
        for n in range(topo.num_nodes):
            names[fabric.snic_read[n]] = f"node{n} snic_read"
            names[fabric.snic_write[n]] = f"node{n} snic_write"
            names[fabric.dram[n]] = f"node{n} dram"
        for e in topo.engine_ids:
            kind = topo.kind_of(e).value
            names[fabric.tx[e]] = f"node{topo.node_of(e)} {kind}{e}_cnic_tx"
            names[fabric.rx[e]] = f"node{topo.node_of(e)} {kind}{e}_cnic_rx"
        return names
