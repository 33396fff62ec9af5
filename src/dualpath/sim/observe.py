"""Read-only observation of a running ``Cluster`` through its events: spans, per-forward
attention, SNIC bytes.

An ``Observer`` subscribes to the cluster's ``EventBus`` before the run starts and records
Chrome-trace spans (every transfer that takes time, each forward pass per PE, decode
intervals per DE), each forward's attention time per GPU of the EP group (the same
``cost.attention_time_s`` the prefill group charges) and cumulative SNIC read bytes per node
sampled by the driver. It changes no timing and no decision: a run with and without an
observer has the same event-log digest (tested).
"""

from __future__ import annotations

from dualpath.ledger import DecodeStepsDone, ForwardDone, ForwardStarted, TransferDone
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
        events = cluster.events
        events.subscribe(ForwardStarted, self._on_forward_started)
        if spans:
            events.subscribe(ForwardDone, self._on_forward_done)
            events.subscribe(TransferDone, self._on_transfer_done)
            events.subscribe(DecodeStepsDone, self._on_decode_steps)

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

    def _on_forward_done(self, ev: ForwardDone) -> None:
        topo = self.cluster.topo
        for pe, chunks in sorted(ev.batches):
            args = {"new_tokens": sum(new for _, new in chunks)}
            track = f"node{topo.node_of(pe)}"
            self.spans.append(Span(f"pe{pe} forward", "prefill", ev.start_s, ev.now, args, track))

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
                args = {"steps": ev.steps, "batch": batch}
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
