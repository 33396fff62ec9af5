"""Timing of one PE forward pass: its compute, KV loads, KV sends and collective (design §8).

``AggregatePass`` starts every flow of the pass at once (KV flows paced over the pass) and,
when all have landed, places the pass end by the layer-pipeline closed form (``pipeline.py``)
on the stage times. ``PerLayerPass`` simulates the same pass layer by layer (the reference;
slow). On uncontended resources both give the same end time (``tests/sim/test_passes.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from dualpath.sim.events import EventLoop, Priority
from dualpath.sim.pipeline import layerwise_pass_s
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath

Transfer = tuple[str, tuple[int, ...], float]  # (path kind, path, bytes over all layers)
_LOADS = (KVPath.PE_BUFFER_TO_PE_HBM.value, KVPath.DE_BUFFER_TO_PE_HBM.value)
_SENDS = (KVPath.PE_HBM_TO_DE_BUFFER.value,)


@dataclass(slots=True)
class PassPlan:
    """What one forward pass computes (``compute_s``: slowest GPU's attention + linear, all
    layers) and moves (``loads`` into HBM, ``sends`` to DE buffers, MoE ``collective``)."""

    compute_s: float
    loads: list[Transfer] = field(default_factory=list)
    sends: list[Transfer] = field(default_factory=list)
    collective: Transfer | None = None


class AggregatePass:
    """Starts every flow of the pass at once; KV loads and sends are paced over the pass
    (rate cap = bytes / compute time: each layer's Layer Blocks move while a neighbouring
    layer computes), the collective bursts at full speed. When all have landed the pass ends
    at t0 + ``layerwise_pass_s`` of the stage times. Not layerwise (the classic path): loads
    first, unpaced; then compute and the collective; then the sends, unpaced; the pass ends
    when the last send lands (``serial_pass_s`` on uncontended resources).

    A stage's time is its slowest flow's time; a flow that was held to its pace counts with
    its uncontended time (bytes over its slowest resource), as its layers would have moved
    at full speed within each layer's window."""

    def __init__(
        self,
        loop: EventLoop,
        transfers: Transfers,
        num_layers: int,
        plan: PassPlan,
        layerwise: bool,
        on_done: Callable[[], None],
        on_loaded: Callable[[], None] | None = None,
    ) -> None:
        self.loop = loop
        self.transfers = transfers
        self.num_layers = num_layers
        self.plan = plan
        self.layerwise = layerwise
        self.on_done = on_done
        self.on_loaded = on_loaded  # classic path: the batch's KV is in HBM
        self.t0 = 0.0
        self.load_s = 0.0
        self.flows: list[Transfer] = []
        self.paced = False
        self.ends: dict[int, float] = {}
        self.pending = 0
        self.collective_s = 0.0  # how long the collective took (set at the end)
        self.compute_end_s = 0.0

    def start(self) -> None:
        plan = self.plan
        self.t0 = self.loop.now
        if self.layerwise:
            self._stage([*plan.loads, *plan.sends], True, self._finish_layerwise)
        else:
            self._stage(plan.loads, False, self._after_load)

    def _stage(self, flows: list[Transfer], paced: bool, then: Callable[[], None]) -> None:
        """Start ``flows`` (and, when paced, i.e. alongside compute, the collective)."""
        self.flows = flows
        self.paced = paced
        self.ends = {}
        collective = self.plan.collective if paced else None
        self.pending = len(flows) + (1 if collective else 0)
        if not self.pending:
            then()
            return
        compute_s = self.plan.compute_s
        for i, (kind, path, size) in enumerate(flows):
            cap = size / compute_s if paced and compute_s > 0 else math.inf
            self.transfers.start(kind, path, size, partial(self._flow_done, i, then), cap)
        if collective:
            kind, path, size = collective
            self.transfers.start(kind, path, size, partial(self._flow_done, -1, then))

    def _flow_done(self, index: int, then: Callable[[], None]) -> None:
        self.ends[index] = self.loop.now
        self.pending -= 1
        if self.pending == 0:
            then()

    def _stage_s(self, kinds: tuple[str, ...]) -> float:
        held = self.plan.compute_s * (1 + 1e-9)
        worst = 0.0
        for i, (kind, path, size) in enumerate(self.flows):
            if kind not in kinds:
                continue
            took = self.ends[i] - self.t0
            if self.paced and took <= held:
                took = min(took, self.transfers.nominal_s(path, size))
            worst = max(worst, took)
        return worst

    def _compute_s(self) -> float:
        self.collective_s = self.ends.get(-1, self.t0) - self.t0
        return max(self.plan.compute_s, self.collective_s)

    def _finish_layerwise(self) -> None:
        load = self._stage_s(_LOADS)
        send = self._stage_s(_SENDS)
        end = self.t0 + layerwise_pass_s(self.num_layers, load, self._compute_s(), send)
        self._end_at(end)

    def _after_load(self) -> None:
        """Classic path (design §8/§11): the whole batch's KV is in HBM; compute (and the
        collective) runs, and only after the forward pass is the KV sent to the DE."""
        self.load_s = self._stage_s(_LOADS)
        if self.on_loaded is not None:
            self.on_loaded()
        self.t0 = self.loop.now
        collective = self.plan.collective
        self.ends = {}
        self.pending = 2 if collective else 1
        self.loop.after(
            self.plan.compute_s,
            partial(self._flow_done, -2, self._after_compute),
            Priority.COMPLETION,
            "pe_compute_end",
        )
        if collective:
            kind, path, size = collective
            self.transfers.start(
                kind, path, size, partial(self._flow_done, -1, self._after_compute)
            )

    def _after_compute(self) -> None:
        self.compute_end_s = self.loop.now
        self.collective_s = self.ends.get(-1, self.t0) - self.t0
        self._stage(self.plan.sends, False, self._finish_serial)

    def _finish_serial(self) -> None:
        self._end_at(self.loop.now)

    def _end_at(self, end_s: float) -> None:
        self.loop.at(max(end_s, self.loop.now), self.on_done, Priority.COMPLETION, "pe_pass_end")


class PerLayerPass:
    """Layer l: its Layer Blocks load (1/L of every load flow), then its compute (1/L of the
    compute, and 1/L of the collective), then its send (1/L of every send flow). HBM holds two
    layers of loaded KV (double buffering): layer l+1 loads once layer l's compute started.
    Each stage handles one layer at a time, in layer order."""

    def __init__(
        self,
        loop: EventLoop,
        transfers: Transfers,
        num_layers: int,
        plan: PassPlan,
        on_done: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.transfers = transfers
        self.num_layers = num_layers
        self.plan = plan
        self.on_done = on_done
        self.loaded = 0  # layers whose KV is in HBM
        self.load_next = 0
        self.loading = False
        self.started = 0  # layers whose compute started
        self.computed = 0
        self.sent = 0
        self.computing = False
        self.sending = False

    def start(self) -> None:
        self._load()

    def _group(self, flows: list[Transfer], then: Callable[[], None]) -> None:
        """Start 1/L of each flow; ``then`` once all of them are done."""
        left = [len(flows)]
        if not flows:
            self.loop.at(self.loop.now, then, Priority.COMPLETION, "layer_step")
            return

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                then()

        for kind, path, size in flows:
            self.transfers.start(kind, path, size / self.num_layers, one_done)

    def _load(self) -> None:
        if self.loading or self.load_next >= self.num_layers or self.load_next > self.started:
            return
        self.loading = True

        def done() -> None:
            self.loading = False
            self.load_next += 1
            self.loaded += 1
            self._load()
            self._compute()

        self._group(self.plan.loads, done)

    def _compute(self) -> None:
        if self.computing or self.computed >= self.loaded:
            return
        self.computing = True
        self.started += 1
        self._load()
        left = [2]

        def part_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.computing = False
                self.computed += 1
                self._send()
                self._compute()

        self.loop.after(
            self.plan.compute_s / self.num_layers, part_done, Priority.COMPLETION, "layer_compute"
        )
        self._group([self.plan.collective] if self.plan.collective else [], part_done)

    def _send(self) -> None:
        if self.sending or self.sent >= self.computed:
            return
        self.sending = True

        def done() -> None:
            self.sending = False
            self.sent += 1
            if self.sent == self.num_layers:
                self.on_done()
            else:
                self._send()

        self._group(self.plan.sends, done)
