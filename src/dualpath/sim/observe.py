"""Read-only observation of a running ``Cluster``: spans, per-forward attention, SNIC bytes.

An ``Observer`` wraps a few cluster methods on the *instance* (never the class) before the
run starts, records what happened and hands it to ``dualpath.metrics``: Chrome-trace spans
(reads and every other transfer, each prefill forward pass per PE, decode macro-steps per DE
group), each forward's attention time per GPU of the EP group (recomputed with the same
``cost.attention_time_s`` call the prefill group makes) and cumulative SNIC read bytes per
node sampled by the driver. It changes no timing and no decision: a run with and without an
observer has the same event-log digest (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dualpath.metrics.chrome_trace import Span
from dualpath.models import cost
from dualpath.sim.cluster import Cluster
from dualpath.types import EngineKind


class Observer:
    """Attach with ``Observer(cluster, spans=True)`` before running the cluster's loop."""

    def __init__(self, cluster: Cluster, spans: bool = False) -> None:
        self.cluster = cluster
        self.record_spans = spans
        self.spans: list[Span] = []
        self.attention: list[tuple[float, list[float]]] = []  # (pass start s, s per GPU)
        self.snic_samples: list[tuple[float, list[float]]] = []  # (time s, cumulative bytes)
        for group in cluster.prefill_groups:
            self._wrap_prefill(group)
        if spans:
            self._wrap_transfers()
            for dgroup in cluster.decode_groups:
                self._wrap_decode(dgroup)

    # ------------------------------------------------------------------ samples
    def sample_snic(self) -> None:
        """Append (now, cumulative SNIC read bytes per node) — call at regular times."""
        c = self.cluster
        carried = [c.net.bytes_carried(c.topo.snic_read[n]) for n in range(c.topo.num_nodes)]
        self.snic_samples.append((c.loop.now, carried))

    # ------------------------------------------------------------------ wrappers
    def _wrap_prefill(self, group: Any) -> None:
        make_plan: Callable[[Any], Any] = group._make_plan
        end_pass: Callable[[], None] = group._end_pass
        model, hw, loop = self.cluster.config.model, self.cluster.config.hardware, self.cluster.loop
        members: Sequence[int] = group.members
        started: list[tuple[float, dict[int, int]]] = []

        def observed_plan(batches: list[tuple[int, Any]]) -> Any:
            per_gpu = dict.fromkeys(members, 0.0)
            tokens: dict[int, int] = {}
            for pe, chunks in batches:
                per_gpu[pe] = cost.attention_time_s(model, hw, [(c.cached, c.new) for c in chunks])
                tokens[pe] = sum(c.new for c in chunks)
            if len(members) > 1:
                self.attention.append((loop.now, [per_gpu[pe] for pe in members]))
            started.append((loop.now, tokens))
            return make_plan(batches)

        def observed_end() -> None:
            if started and self.record_spans:
                start, tokens = started[-1]
                for pe, new in sorted(tokens.items()):
                    node = self.cluster.topo.node_of(pe)
                    args = {"new_tokens": new}
                    self.spans.append(
                        Span(f"pe{pe} forward", "prefill", start, loop.now, args, f"node{node}")
                    )
            started.clear()
            end_pass()

        group._make_plan = observed_plan
        group._end_pass = observed_end

    def _wrap_transfers(self) -> None:
        transfers = self.cluster.transfers
        start = transfers.start
        loop = self.cluster.loop
        names = self._resource_names()

        def observed_start(
            kind: str, path: Sequence[int], size_bytes: float, on_done: Any, *a: Any
        ) -> None:
            t0 = loop.now
            track = names.get(path[0], f"res{path[0]}") if path else "none"
            node = track.split(" ", 1)[0]

            def done() -> None:
                if loop.now > t0:
                    args = {"bytes": size_bytes, "path": [names.get(r, str(r)) for r in path]}
                    self.spans.append(Span(f"{track} {kind}", kind, t0, loop.now, args, node))
                on_done()

            start(kind, path, size_bytes, done, *a)

        transfers.start = observed_start  # type: ignore[method-assign,assignment]

    def _resource_names(self) -> dict[int, str]:
        topo = self.cluster.topo
        names: dict[int, str] = {}
        for n in range(topo.num_nodes):
            names[topo.snic_read[n]] = f"node{n} snic_read"
            names[topo.snic_write[n]] = f"node{n} snic_write"
            names[topo.dram[n]] = f"node{n} dram"
        for e in topo.engine_ids:
            kind = "pe" if topo.kind_of_node(topo.node_of(e)) is EngineKind.PE else "de"
            names[topo.tx[e]] = f"node{topo.node_of(e)} {kind}{e}_cnic_tx"
            names[topo.rx[e]] = f"node{topo.node_of(e)} {kind}{e}_cnic_rx"
        return names

    def _wrap_decode(self, group: Any) -> None:
        boundary: Callable[[], None] = group._boundary
        loop, topo = self.cluster.loop, self.cluster.topo

        def observed_boundary() -> None:
            steps = len(group.times)
            if steps:
                for de, batch in zip(group.members, group.batch, strict=True):
                    if batch:
                        node = topo.node_of(de)
                        args = {"steps": steps, "batch": batch}
                        self.spans.append(
                            Span(
                                f"de{de} decode",
                                "decode",
                                group.interval_start_s,
                                loop.now,
                                args,
                                f"node{node}",
                            )
                        )
            boundary()

        group._boundary = observed_boundary
