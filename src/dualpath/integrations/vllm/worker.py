"""The connector's worker half, without vLLM: carries out a ``StepMeta`` on the paged KV.

Loads run layer by layer: ``wait_for_layer(l)`` copies layer ``l`` of every load of the step
from its node buffer's slots into the paged blocks right before layer ``l``'s attention runs
(design §8: HBM needs only the layer being computed; a PE reading from the DE buffer reads over
the compute network, here a copy out of the DE node's shared memory). Saves run as each
layer's attention has written its KV (``save_layer``). At the end of the step (``end_step``)
the decode's loaded slots are handed to its side-car for persistence (or freed), and the blocks
its generation filled are copied into fresh slots and persisted.

A load that fails (a buffer that cannot be attached, a slot out of range) marks the request's
blocks as failed (``take_load_errors``): vLLM recomputes them (``kv_load_failure_policy``
``recompute``). Bytes moved are counted per path for the router's metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from dualpath.integrations.vllm.blocks import PagedLayout, SlotView, load_layer, save_layer
from dualpath.integrations.vllm.node import NodeSpec, attach_buffer, call, instance_owner
from dualpath.integrations.vllm.plan import BlockCopy, StepMeta
from dualpath.kv.buffer import SlotBuffer
from dualpath.types import KVPath

SidecarCall = Callable[[str, dict[str, Any]], dict[str, Any]]


class WorkerSide:
    """One vLLM worker's view of the node buffers (``nodes``) from node ``node``."""

    def __init__(
        self,
        nodes: dict[int, NodeSpec],
        node: int,
        block_tokens: int,
        sidecar: SidecarCall = call,
    ) -> None:
        if node not in nodes:
            raise ValueError(f"node={node} is invalid: the node specs list {sorted(nodes)}")
        self.nodes = nodes
        self.node = node
        self.block_tokens = block_tokens
        self._sidecar = sidecar
        self._buffers: dict[int, SlotBuffer] = {}
        self._views: dict[int, SlotView] = {}
        self.layout: PagedLayout | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self.meta = StepMeta()
        self._failed_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self.bytes_by_path: dict[str, int] = {}

    # ---------------------------------------------------------------- setup
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The paged KV per layer; checks that a slot holds exactly one Full Block of it."""
        self.layout = PagedLayout.of(kv_caches, self.block_tokens)
        self.kv_caches = kv_caches
        self._layer_of = {n: i for i, n in enumerate(self.layout.layer_names)}
        want = self.layout.store_layout().full_block_bytes
        for spec in self.nodes.values():
            if spec.layout.full_block_bytes != want:
                raise ValueError(
                    f"node {spec.node}: a buffer slot holds {spec.layout.full_block_bytes} bytes, "
                    f"vLLM's Full Block is {want} ({self.layout.num_layers} layers of "
                    f"{self.layout.block_shape} {self.layout.dtype})"
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
        self.bytes_by_path[path.value] = self.bytes_by_path.get(path.value, 0) + nbytes

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
        for job in self.meta.loads:
            if job.request_id in self._failed_loads:
                continue
            try:
                nbytes = load_layer(kv, job.block_ids, self._view(job.node), job.slots, layer)
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
        if layer is None:
            return
        for job in self.meta.saves:
            nbytes = save_layer(kv_layer, job.block_ids, self._view(job.node), job.slots, layer)
            self._count(KVPath.PE_HBM_TO_DE_BUFFER, nbytes)

    def end_step(self) -> None:
        """After every layer ran: persistence of the decode's blocks, then the step is over."""
        meta = self.meta
        mine = instance_owner(self.node)
        for sp in meta.slot_persists:
            if sp.request_id in self._failed_loads:  # what the slots hold is not trusted
                self._buffer(sp.node).release([*sp.slots, *sp.free], mine)
                continue
            if sp.free:
                self._buffer(sp.node).release(list(sp.free), mine)
            if sp.keys:
                self._persist(sp.node, list(sp.keys), list(sp.slots))
        for bp in meta.block_persists:
            self._persist_blocks(bp.node, list(bp.block_ids), list(bp.keys))
        self.meta = StepMeta()

    def _buffer(self, node: int) -> SlotBuffer:
        self._view(node)
        return self._buffers[node]

    def _persist(self, node: int, keys: list[str], slots: list[int]) -> None:
        """Hand the slots to the node's side-car, inside the step: the write must be queued
        there before the answer ends, so that the router's ``settle`` for the next turn sees
        it (a hand-over on a thread of its own lost that race: the next turn missed its hits)."""
        spec = self.nodes[node]
        try:
            self._sidecar(spec.control, {"op": "write", "keys": keys, "slots": slots})
        except (OSError, ValueError) as err:  # the side-car is gone: the blocks stay uncached
            print(f"dualpath connector: persist on node {node} failed ({err})", file=sys.stderr)
            # what it did not take is still this instance's
            self._buffer(node).release(slots, instance_owner(self.node))

    def _persist_blocks(self, node: int, block_ids: list[int], keys: list[str]) -> None:
        buf, view = self._buffer(node), self._view(node)
        slots = buf.alloc(len(block_ids), owner=instance_owner(self.node))
        if slots is None:  # the DE buffer is full: these blocks are recomputed next turn
            return
        assert self.layout is not None
        for layer, name in enumerate(self.layout.layer_names):
            save_layer(self.kv_caches[name], block_ids, view, slots, layer)
        self._persist(node, keys, slots)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self._views.clear()
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
