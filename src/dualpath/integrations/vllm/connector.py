"""DualPath as a vLLM KV connector (``KVConnectorBase_V1``), loaded by module path.

    --kv-transfer-config '{"kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node": 0, "nodes": [NodeSpec, ...]}}'

A thin adapter: the scheduler half is ``plan.StepPlanner`` and the worker half
``worker.WorkerSide``; this module only translates vLLM's request and scheduler-output objects
into theirs. What a request does (load, save, persist) comes from the router in the request's
``kv_transfer_params["dualpath"]`` (``params.TransferParams``); a request without it runs as in
plain vLLM. Needs vLLM (imported here only; nothing else of ``dualpath`` imports this module).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from dualpath.integrations.vllm.node import BufferOwners, NodeSpec, describe, instance_owner
from dualpath.integrations.vllm.params import KEY, TransferParams
from dualpath.integrations.vllm.plan import StepMeta, StepPlanner
from dualpath.integrations.vllm.worker import Rank, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class DualPathConnectorMetadata(KVConnectorMetadata):
    step: StepMeta


def _node_specs(extra: dict[str, Any]) -> tuple[int, dict[int, NodeSpec]]:
    """This instance's node and every node's spec: given (``nodes``, as `dualpath serve
    --engine vllm` writes them), or asked of each node's side-car (``sidecars``: their
    ``tcp://HOST:PORT``, as an operator writes them for `dualpath sidecar`, docs/deploy.md)."""
    try:
        if "sidecars" in extra:
            specs = [describe(str(a))[0] for a in extra["sidecars"]]
            nodes = {s.node: s for s in specs}
        else:
            nodes = {int(d["node"]): NodeSpec(**d) for d in extra["nodes"]}
        node = int(extra["node"])
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise ValueError(
            f"kv_connector_extra_config is invalid for DualPathConnector: {err} (needs 'node' "
            "and 'sidecars' or 'nodes')"
        ) from None
    if node not in nodes:
        raise ValueError(
            f"kv_connector_extra_config: node {node} is not among the side-cars' "
            f"nodes {sorted(nodes)}"
        )
    return node, nodes


# the KV cache groups the connector copies: full attention (MLA's latent too) and sliding
# windows (a hybrid model's groups; vLLM's null block stands for what a window skipped)
SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec")


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """What of this instance's model or layout the connector does not handle, in one line
    (None: nothing). Checked when vLLM builds the connector, before any request."""
    model = vllm_config.model_config
    if model is not None and getattr(model, "use_sparse", False):  # DeepSeek-V3.2's DSA
        return (
            f"{model.model}: sparse attention (DSA: an indexer cache beside the latent) is "
            "not in the connector's block layout"
        )
    if kv_cache_config is not None:
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            kind = type(group.kv_cache_spec).__name__
            if kind not in SUPPORTED_SPECS:
                return (
                    f"KV cache group {i} ({', '.join(group.layer_names[:2])}…) is {kind}: the "
                    f"connector handles {', '.join(SUPPORTED_SPECS)}"
                )
    return None


def _rank(vllm_config: VllmConfig) -> Rank:
    """This worker's place in its instance (vLLM's process groups exist by now)."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    model = vllm_config.model_config
    pp = get_pp_group()
    return Rank(
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
        pp.rank_in_group,
        pp.world_size,
        model.get_total_num_kv_heads() if not model.use_mla else 1,
        bool(model.use_mla),
    )


def _layer_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    if kv_cache_config is None:
        return {}
    return {
        name: g
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }


def _fp8_kind(cache_dtype: str) -> str:
    """A cache dtype's byte encoding ("fp8" is vLLM's name for fp8_e4m3)."""
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def _windows(kv_cache_config: KVCacheConfig | None) -> list[int]:
    """Each KV cache group's sliding window in tokens (0: full attention)."""
    if kv_cache_config is None:
        return []
    return [
        int(getattr(g.kv_cache_spec, "sliding_window", 0) or 0)
        if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"
        else 0
        for g in kv_cache_config.kv_cache_groups
    ]


class DualPathConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads hit KV layer by layer from a node buffer (PE or DE read path), saves a prefill's
    KV per layer toward the decode node's buffer, persists a decode's blocks to the store.
    Every worker of a tensor- or pipeline-parallel instance copies its own heads and layers
    of the canonical blocks; a hybrid model's KV cache groups each copy their own blocks."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        why = unsupported(vllm_config, kv_cache_config)
        if why is not None:
            raise ValueError(f"DualPathConnector: {why}")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._node, self._nodes = _node_specs(extra)
        self._block_tokens = vllm_config.cache_config.block_size
        mine = self._nodes[self._node]
        if mine.block_tokens != self._block_tokens:
            raise ValueError(
                f"DualPathConnector: node {self._node}'s side-car stores blocks of "
                f"{mine.block_tokens} tokens, this instance's block size is {self._block_tokens}"
                f" (--block-size {mine.block_tokens})"
            )
        cache = vllm_config.cache_config.cache_dtype
        if _fp8_kind(cache) != _fp8_kind(mine.cache_dtype):
            raise ValueError(
                f"DualPathConnector: node {self._node}'s side-car holds blocks of "
                f"kv_cache_dtype={mine.cache_dtype}, this instance's cache is {cache} "
                f"(--kv-cache-dtype {mine.cache_dtype})"
            )
        self._owners = BufferOwners(self._nodes, instance_owner(self._node))
        # persist jobs are named apart from any other instance or restart on the side-car
        job_prefix = f"n{self._node}-{os.getpid()}-{time.monotonic_ns()}"
        self._planner = StepPlanner(
            self._block_tokens,
            self._owners,
            job_prefix,
            _windows(kv_cache_config),
            steps_in_flight=max(1, int(vllm_config.max_concurrent_batches)),
        )
        self._worker: WorkerSide | None = None
        self._bound: KVConnectorMetadata | None = None  # the step metadata the worker has
        self._groups = _layer_groups(kv_cache_config)
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(
                self._nodes, self._node, self._block_tokens, rank=_rank(vllm_config)
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-by-layer loads and saves run Python between the layers: never inside a
        captured CUDA graph."""
        return True

    # ------------------------------------------------------------ scheduler side
    def _params(self, request: Request) -> TransferParams | None:
        try:
            return TransferParams.from_request(request.kv_transfer_params)
        except ValueError as err:  # the router's bug or a hand-made request: run it plainly
            logger.warning("request %s: %s; served without DualPath", request.request_id, err)
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not request.kv_transfer_params or KEY not in request.kv_transfer_params:
            return 0, False
        prompt = request.prompt_token_ids or []
        count = self._planner.matched_tokens(
            request.request_id,
            self._params(request),
            request.all_token_ids,
            len(prompt),
            num_computed_tokens,
        )
        return count, False  # the router read the blocks into a buffer before sending it

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        counts = scheduler_output.num_scheduled_tokens
        new = [
            (r.req_id, r.block_ids, r.num_computed_tokens, counts.get(r.req_id, 0))
            for r in scheduler_output.scheduled_new_reqs
            if self._planner.knows(r.req_id)
        ]
        c = scheduler_output.scheduled_cached_reqs
        cached = [
            (
                rid,
                c.new_block_ids[i],
                rid in c.resumed_req_ids,
                c.num_computed_tokens[i],
                counts.get(rid, 0),
            )
            for i, rid in enumerate(c.req_ids)
            if self._planner.knows(rid)
        ]
        return DualPathConnectorMetadata(self._planner.step(new, cached))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._planner.step_done()  # once per step, in the order they were planned

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = None
        if request.kv_transfer_params and KEY in request.kv_transfer_params:
            params = self._params(request)
        self._planner.finished(request.request_id, params)
        return False, None  # saves and persists finish inside their step: free at once

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A hybrid model's request left vLLM: as ``request_finished`` (every group's blocks
        may be freed at once: nothing is copied out of them after the step)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._groups)
        lay = self._worker.layout
        assert lay is not None
        # one line per worker in the instance's log, whatever vLLM's log level: what it copies
        print(
            f"dualpath connector: node {self._node}, rank {self._worker.rank.name} (pp.tp), "
            f"layers {list(lay.layer_index)} of {lay.num_layers}, Layer Block "
            f"{list(lay.block_shape)} of {list(lay.canonical_shape)} {lay.dtype} "
            f"({lay.layer_block_bytes} bytes), {len(set(self._groups.values())) or 1} "
            f"KV cache group(s), writer {lay.rank.writer}",
            file=sys.stderr,
            flush=True,
        )

    def _sync_step(self) -> WorkerSide:
        """Hand the step's metadata to the worker half once, at the first call of the step
        that needs it: vLLM binds it before the forward pass but calls ``start_load_kv``
        after the forward when the step has no synchronous loads (its saves run before)."""
        assert self._worker is not None
        meta = self._connector_metadata
        if meta is not self._bound and isinstance(meta, DualPathConnectorMetadata):
            self._bound = meta
            self._worker.start_step(meta.step)
        return self._worker

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._sync_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._sync_step().wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._sync_step().save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._sync_step().end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        self._owners.close()
        if self._worker is not None:
            self._worker.close()
