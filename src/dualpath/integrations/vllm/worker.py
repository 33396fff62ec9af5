"""The connector's worker half, without vLLM: carries out a ``StepMeta`` on the paged KV.

Loads run layer by layer: ``wait_for_layer(l)`` copies layer ``l`` of every load of the step
from its node buffer's slots into the paged blocks right before layer ``l``'s attention runs
(design §8: HBM needs only the layer being computed; a PE reading from the DE buffer reads over
the compute network, here a copy out of the DE node's shared memory). Saves run as each
layer's attention has written its KV (``save_layer``); across nodes each saved layer is reported
to the node's side-car, which pushes it on to the DE buffer while the next layers compute (the
layerwise hand-over, ``cnic.py``). At the end of the step (``end_step``)
the decode's loaded slots are handed to its side-car for persistence (or freed), and the blocks
its generation filled are copied into fresh slots and persisted.

Each worker of a tensor- or pipeline-parallel instance runs its own ``WorkerSide`` over the
same ``StepMeta`` (``Rank``): it loads and saves its own KV heads of its own layers
(``blocks.RankSlice``), and a persist is carried out by the side-car once every worker's part
is in (``sidecar.NodeSidecar.part``): every loader's for slots a decode loaded from, every
writer's for slots its generated blocks were copied into. A hybrid model's layers each copy
their KV cache group's blocks.

A load that fails (a buffer that cannot be attached, a slot out of range) marks the request's
blocks as failed (``take_load_errors``): vLLM recomputes them (``kv_load_failure_policy``
``recompute``). Bytes moved are counted per path for the router's metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from dualpath.integrations.vllm.blocks import (
    PagedLayout,
    RankSlice,
    SlotView,
    load_layer,
    save_layer,
)
from dualpath.integrations.vllm.node import NodeSpec, SidecarPool, attach_buffer, instance_owner
from dualpath.integrations.vllm.plan import BlockCopy, PagedPersist, StepMeta
from dualpath.kv.buffer import SlotBuffer
from dualpath.ledger.counters import VLLM_PATHS, RunCounters
from dualpath.types import KVPath

SidecarCall = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Rank:
    """One worker among its instance's: tensor-parallel rank and size, pipeline stage and
    count, and the model's KV heads (``total_heads``; MLA: one latent, the same on every
    tensor-parallel rank)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    total_heads: int = 1
    mla: bool = False

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(
                f"rank tp {self.tp_rank}/{self.tp_size} pp {self.pp_rank}/{self.pp_size} "
                "is invalid: each rank must be below its size"
            )

    @property
    def name(self) -> str:
        return f"{self.pp_rank}.{self.tp_rank}"

    @property
    def num_loaders(self) -> int:
        """Workers that load a block: every one of the instance."""
        return self.tp_size * self.pp_size

    @property
    def num_writers(self) -> int:
        """Workers that write a part of a block: one per distinct slice of each stage."""
        per_stage = 1 if self.tp_size == 1 or self.mla else min(self.tp_size, self.total_heads)
        return per_stage * self.pp_size


class WorkerSide:
    """One vLLM worker's view of the node buffers (``nodes``) from node ``node``."""

    def __init__(
        self,
        nodes: dict[int, NodeSpec],
        node: int,
        block_tokens: int,
        sidecar: SidecarCall | None = None,
        rank: Rank | None = None,
    ) -> None:
        """``sidecar``: how side-cars are asked (default: a ``SidecarPool``: the step's
        hand-overs reuse kept connections)."""
        if node not in nodes:
            raise ValueError(f"node={node} is invalid: the node specs list {sorted(nodes)}")
        self.nodes = nodes
        self.node = node
        self.block_tokens = block_tokens
        self.rank = rank or Rank()
        self._sidecar = sidecar or SidecarPool().call
        self._group_of: dict[str, int] = {}
        self._buffers: dict[int, SlotBuffer] = {}
        self._views: dict[int, SlotView] = {}
        self.layout: PagedLayout | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self.meta = StepMeta()
        self._failed_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self.counters = RunCounters.over(VLLM_PATHS)  # KV bytes per load path
        self._reporter: ThreadPoolExecutor | None = None  # layer reports (``_report_layer``)
        self._reports: list[Future[dict[str, Any]]] = []

    # ---------------------------------------------------------------- setup
    def register(
        self, kv_caches: dict[str, torch.Tensor], layer_groups: dict[str, int] | None = None
    ) -> None:
        """The paged KV per layer (``layer_groups``: each layer's KV cache group, 0 if not
        given); checks that a slot holds exactly one canonical Full Block of it: a mismatch
        is a ValueError naming both sides' layout."""
        first = next(iter(kv_caches.values()), None)
        shape = tuple(first.shape[1:]) if first is not None else ()
        r = self.rank
        try:
            part = RankSlice.of_rank(shape, r.tp_rank, r.tp_size, r.total_heads, r.mla)
        except ValueError as err:
            raise ValueError(f"DualPathConnector: {err}") from None
        mine = self.nodes[self.node].layout
        self.layout = PagedLayout.of(kv_caches, self.block_tokens, mine.num_layers, part)
        self.kv_caches = kv_caches
        self._layer_of = dict(zip(self.layout.layer_names, self.layout.layer_index, strict=True))
        self._group_of = dict(layer_groups or {})
        got = self.layout.store_layout()
        for spec in self.nodes.values():
            want = spec.layout
            if (want.num_layers, want.block_tokens, want.row_bytes) != (
                got.num_layers,
                got.block_tokens,
                got.row_bytes,
            ):
                raise ValueError(
                    f"DualPathConnector: node {spec.node}'s buffer holds blocks of "
                    f"{want.num_layers} layers x {want.block_tokens} tokens x {want.row_bytes} "
                    f"bytes, this instance's are {got.num_layers} x {got.block_tokens} x "
                    f"{got.row_bytes} (a layer block {self.layout.canonical_shape} "
                    f"{self.layout.dtype}): the deployment was planned for another model, "
                    "block size or cache dtype"
                )

    def _view(self, node: int) -> SlotView:
        view = self._views.get(node)
        if view is None:
            if node not in self.nodes:
                raise ValueError(f"node {node} is not in the connector's node list")
            buf = self._buffers[node] = attach_buffer(self.nodes[node])
            assert self.layout is not None
            view = self._views[node] = SlotView(buf.data, buf.spec.stride_bytes, self.layout)
        return view

    def _count(self, path: KVPath, nbytes: int) -> None:
        self.counters.moved(path, nbytes)

    def _load_path(self, node: int) -> KVPath:
        if self.nodes[self.node].kind == "de":
            return KVPath.DE_BUFFER_TO_DE_HBM
        return KVPath.PE_BUFFER_TO_PE_HBM if node == self.node else KVPath.DE_BUFFER_TO_PE_HBM

    # ---------------------------------------------------------------- a step
    def start_step(self, meta: StepMeta) -> None:
        self.meta = meta
        self._failed_loads = set()
        for job in meta.lost:  # leased slots the router took back: nothing to load from
            self._fail(job, ValueError("its slots were no longer leased to it"))

    def wait_for_layer(self, layer_name: str) -> None:
        """Layer ``layer_name``'s loads of this step, before its attention runs."""
        layer = self._layer_of.get(layer_name)
        if layer is None or not self.meta.loads:
            return
        kv = self.kv_caches[layer_name]
        group = self._group_of.get(layer_name, 0)
        for job in self.meta.loads:
            if job.request_id in self._failed_loads:
                continue
            try:
                ids = job.group(group)
                nbytes = load_layer(kv, ids, self._view(job.node), job.slots, layer)
            except (OSError, ValueError, IndexError, RuntimeError) as err:
                self._fail(job, err)
                continue
            self._count(self._load_path(job.node), nbytes)

    def _fail(self, job: BlockCopy, err: BaseException) -> None:
        print(
            f"dualpath connector: load of {job.request_id} failed ({err}); vLLM recomputes "
            f"its {len(job.block_ids)} blocks",
            file=sys.stderr,
        )
        self._failed_loads.add(job.request_id)
        self._load_errors.update(job.block_ids)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Layer ``layer_name``'s saves of this step, as its attention wrote its KV."""
        layer = self._layer_of.get(layer_name)
        if layer is None or self.layout is None or not self.layout.rank.writer:
            return
        kv = self.kv_caches[layer_name]  # as registered (MLA hands a view of other shape)
        group = self._group_of.get(layer_name, 0)
        forwards: dict[int, list[dict[str, Any]]] = {}
        for job in self.meta.saves:
            nbytes = save_layer(kv, job.group(group), self._view(job.node), job.slots, layer)
            self._count(KVPath.PE_HBM_TO_DE_BUFFER, nbytes)
            fw = job.forward
            if fw is not None:
                forwards.setdefault(job.node, []).append(
                    {
                        "job": fw.job,
                        "slots": list(job.slots[: len(fw.slots)]),
                        "to": self.nodes[fw.node].control,
                        "to_slots": list(fw.slots),
                    }
                )
        for node, jobs in forwards.items():
            self._report_layer(node, layer, jobs)

    def _report_layer(self, node: int, layer: int, jobs: list[dict[str, Any]]) -> None:
        """Layer ``layer`` of ``jobs`` is in node ``node``'s buffer: its side-car pushes it on
        once every writer of the layer reported (``cnic.ComputeNic.push_layer``). Sent by a
        thread of the worker's own while the next layers compute; ``end_step`` waits for it."""
        r = self.rank
        op = {
            "op": "push_layer",
            "layer": layer,
            "part": r.name,
            "parts": r.num_writers // r.pp_size,  # this stage's writers of each of its layers
            "jobs": jobs,
        }
        if self._reporter is None:
            self._reporter = ThreadPoolExecutor(1, thread_name_prefix="dualpath-layers")
        self._reports.append(self._reporter.submit(self._sidecar, self.nodes[node].control, op))

    def _reported(self) -> None:
        """Every layer report of the step has reached its side-car (or failed: the router
        then finds those slots missing and pushes them whole)."""
        reports, self._reports = self._reports, []
        failed = 0
        for report in reports:
            try:
                report.result()
            except (OSError, ValueError):
                failed += 1
        if failed:
            print(
                f"dualpath connector: {failed} layer report(s) did not reach the side-car: "
                "the router pushes those blocks after the prefill",
                file=sys.stderr,
                flush=True,
            )

    def end_step(self) -> None:
        """After every layer ran: this worker's parts of the step's persist jobs, handed to
        each node's side-car in one request (inside the step: the write must be queued there
        before the answer ends, so that the router's ``settle`` for the next turn sees it; a
        hand-over on a thread of its own lost that race: the next turn missed its hits)."""
        self._reported()
        meta, r = self.meta, self.rank
        mine = instance_owner(self.node)
        parts: dict[int, list[dict[str, Any]]] = {}
        for sp in meta.slot_persists:
            parts.setdefault(sp.node, []).append(
                {
                    "job": sp.job,
                    "parts": r.num_loaders,
                    "part": r.name,
                    "keys": list(sp.keys),
                    "slots": list(sp.slots),
                    "free": list(sp.free),
                    "owner": mine,
                    "failed": sp.request_id in self._failed_loads,
                }
            )
        writer = self.layout is not None and self.layout.rank.writer
        for bp in meta.block_persists:
            if not bp.slots or not writer:
                continue
            self._copy_blocks(bp.node, bp)
            parts.setdefault(bp.node, []).append(
                {
                    "job": bp.job,
                    "parts": r.num_writers,
                    "part": r.name,
                    "keys": list(bp.keys),
                    "slots": list(bp.slots),
                    "free": [],
                    "owner": mine,
                }
            )
        for node, ops in sorted(parts.items()):
            self._hand_over(node, ops)
        self.meta = StepMeta()

    def _buffer(self, node: int) -> SlotBuffer:
        self._view(node)
        return self._buffers[node]

    def _hand_over(self, node: int, ops: list[dict[str, Any]]) -> None:
        spec = self.nodes[node]
        try:  # (a refused connect is tried again: ``node.CONNECT_TRIES``)
            self._sidecar(spec.control, {"op": "parts", "parts": ops})
        except (OSError, ValueError) as err:
            # the side-car is gone: the blocks stay uncached, and no later try could cache
            # them (its restart recreates the buffer: the slots hold nothing any more)
            keys = [k for op in ops for k in op["keys"]]
            print(
                f"dualpath connector: {len(keys)} block(s) not persisted on node {node} "
                f"({type(err).__name__}: {err}): {' '.join(keys)}",
                file=sys.stderr,
                flush=True,
            )

    def _copy_blocks(self, node: int, bp: PagedPersist) -> None:
        """This worker's part of generated blocks ``bp``: its layers, its heads."""
        view = self._view(node)
        assert self.layout is not None
        for name, layer in self._layer_of.items():
            ids = bp.group(self._group_of.get(name, 0))
            save_layer(self.kv_caches[name], ids, view, bp.slots, layer)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._reporter is not None:
            self._reporter.shutdown(wait=True)
            self._reporter = None
        self._views.clear()
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
