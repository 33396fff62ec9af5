"""The DualPath connector under a real vLLM ``Scheduler`` (runs in ``.venv-vllm``; the outer
``tests/integrations/test_vllm_scheduler.py`` starts it there).

As vLLM tests its own connectors (``tests/v1/kv_connector/unit``): a real ``Scheduler`` on a
tiny local checkpoint with our connector loaded by module path, driven step by step. Here the
worker half is real too (``WorkerSide`` over real node buffers owned by real side-car
processes), and a stand-in model writes each computed token's KV into the paged cache as a
known function of (token, position, layer). After every step, every computed token of every
running request must hold exactly that value in its paged blocks: a page that was claimed as
loaded but never loaded (the stale KV of a preemption) fails at once, whatever the cause.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from tests.integrations.nodes import running_sidecars  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from dualpath.integrations.vllm.node import NodeSpec, attach_buffer, call  # noqa: E402
from dualpath.integrations.vllm.params import (  # noqa: E402
    BlockLoad,
    BlockPersist,
    BlockSave,
    TransferParams,
)
from dualpath.integrations.vllm.worker import WorkerSide  # noqa: E402

CKPT = os.environ.get("DUALPATH_TINY_CKPT", "")
BS, LAYERS, HEAD_DIM = 32, 2, 64  # the outer test's checkpoint: 2 layers, 1 KV head of 64
ROW = 2 * HEAD_DIM * 4  # K and V of the one head, float32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
PE, DE = 0, 1
TOKEN = 7  # what the stand-in model samples

pytestmark = pytest.mark.skipif(not CKPT, reason="DUALPATH_TINY_CKPT not set (outer test)")


def kv_value(token: int, pos: int, layer: int) -> float:
    """The stand-in model's KV for a token: exact in float32 (< 2**24)."""
    return float(layer * 4_000_000 + token * 2048 + pos)


# ---------------------------------------------------------------------- node side-cars
@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[dict[int, NodeSpec]]:
    with running_sidecars(tmp_path, 24, LAYERS, BS, ROW, "ns") as specs:
        yield specs


def settle(spec: NodeSpec) -> None:
    """Until the side-car has written everything it was given."""
    deadline = time.monotonic() + 30
    while call(spec.socket_path, {"op": "stats"})["unfinished_writes"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ---------------------------------------------------------------------- one instance
class Instance:
    """A real vLLM scheduler with our connector (scheduler half and worker half) of node
    ``node``, over a paged KV cache of ``num_blocks`` blocks, and a stand-in model."""

    def __init__(
        self,
        nodes: dict[int, NodeSpec],
        node: int,
        num_blocks: int,
        max_batched: int = 2048,
        max_seqs: int = 8,
        cache_dtype: str = "auto",
        local_chunk: int = 0,
    ) -> None:
        extra = {"node": node, "nodes": [json.loads(s.to_json()) for s in nodes.values()]}
        config = VllmConfig(
            model_config=ModelConfig(model=CKPT, dtype="float32", seed=0),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=2048,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(
                block_size=BS,
                enable_prefix_caching=False,
                cache_dtype=cache_dtype,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="DualPathConnector",
                kv_connector_module_path="dualpath.integrations.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = num_blocks
        spec: Any = FullAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=HEAD_DIM, dtype=torch.float32
        )
        if local_chunk:  # chunked local attention (Llama 4's): a group kind not handled
            spec = ChunkedLocalAttentionSpec(
                block_size=BS,
                num_kv_heads=1,
                head_size=HEAD_DIM,
                dtype=torch.float32,
                attention_chunk_size=local_chunk,
            )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
        )
        self.sched = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BS,
            log_stats=True,
        )
        self.worker = WorkerSide(nodes, node, BS)
        self.kv = {n: torch.zeros(num_blocks, 1, BS, 2 * HEAD_DIM) for n in NAMES}
        self.worker.register(self.kv)
        self.num_preempted = 0
        self.num_steps = 0
        self.loaded_blocks: list[tuple[str, tuple[int, ...]]] = []
        self.lost: list[str] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: TransferParams) -> None:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, 0)
        req = Request(rid, prompt, sp, None)
        req.kv_transfer_params = {"dualpath": params.to_dict()}
        self.sched.add_request(req)

    def step(self) -> None:
        out = self.sched.schedule()
        self.num_steps += 1
        meta = out.kv_connector_metadata.step  # type: ignore[union-attr]
        self.num_preempted += len(out.preempted_req_ids or ())
        self.loaded_blocks += [(j.request_id, j.block_ids) for j in meta.loads]
        self.lost += [j.request_id for j in meta.lost]
        w = self.worker
        w.start_step(meta)
        for layer, name in enumerate(NAMES):
            w.wait_for_layer(name)
            self._compute(out, layer, name)
            w.save_layer(name, self.kv[name])
        w.end_step()
        errors = w.take_load_errors()
        sampled = []
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # this step ends its prefill
            sampled.append([TOKEN] if done else [])
        runner = ModelRunnerOutput(
            req_ids=list(out.num_scheduled_tokens),
            req_id_to_index={r: i for i, r in enumerate(out.num_scheduled_tokens)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=errors) if errors else None,
        )
        self.sched.update_from_output(out, runner)
        self.check_pages()

    def _compute(self, out: Any, layer: int, name: str) -> None:
        """The forward pass: the KV of every scheduled token, into its paged block."""
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
            start = req.num_computed_tokens - n  # num_computed counts the scheduled ones
            for pos in range(start, start + n):
                tok = req.all_token_ids[pos]
                self.kv[name][blocks[pos // BS], 0, pos % BS, :] = kv_value(tok, pos, layer)

    def check_pages(self) -> None:
        """Every computed token of every live request holds its own KV: never a stale page."""
        for rid, req in self.sched.requests.items():
            if req.status != RequestStatus.RUNNING:
                continue
            (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
            for layer, name in enumerate(NAMES):
                for pos in range(req.num_computed_tokens):
                    got = float(self.kv[name][blocks[pos // BS], 0, pos % BS, 0])
                    want = kv_value(req.all_token_ids[pos], pos, layer)
                    assert got == want, f"{rid}: stale KV at position {pos}, layer {layer}"

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.sched.requests:
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {list(self.sched.requests)}")

    def close(self) -> None:
        self.sched.shutdown()
        self.worker.close()


@pytest.fixture()
def instance(nodes: dict[int, NodeSpec]) -> Iterator[Any]:
    made: list[Instance] = []

    def make(node: int, num_blocks: int, **kw: Any) -> Instance:
        made.append(Instance(nodes, node, num_blocks, **kw))
        return made[-1]

    yield make
    for inst in made:
        inst.close()


# ---------------------------------------------------------------------- the router's part
def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 10 for i in range(n)]


def fill_slots(spec: NodeSpec, tokens: list[int], slots: list[int], first_block: int = 0) -> None:
    """What a prefill (or a storage read) leaves in the DE buffer: each block's true KV."""
    buf = attach_buffer(spec)
    try:
        for i, slot in enumerate(slots):
            block = torch.zeros(LAYERS, BS, 2 * HEAD_DIM)
            for layer in range(LAYERS):
                for off in range(BS):
                    pos = (first_block + i) * BS + off
                    if pos < len(tokens):
                        block[layer, off, :] = kv_value(tokens[pos], pos, layer)
            buf.slot(slot)[:] = block.numpy().tobytes()
    finally:
        buf.close()


def lease(spec: NodeSpec, tokens: list[int], tag: int) -> list[int]:
    """The router's part for a decode: slots leased under ``tag``, holding the prompt's KV."""
    buf = attach_buffer(spec)
    try:
        slots = buf.alloc(-(-len(tokens) // BS), owner=tag)
        assert slots is not None
    finally:
        buf.close()
    fill_slots(spec, tokens, slots)
    return slots


def decode_params(spec: NodeSpec, tokens: list[int], slots: list[int], tag: int) -> TransferParams:
    return TransferParams(
        load=BlockLoad(spec.node, tuple(slots), len(tokens), tag),
        persist=BlockPersist(spec.node, 0, "tenant"),
    )


def free_slots(spec: NodeSpec) -> int:
    buf = attach_buffer(spec)
    try:
        return buf.num_free
    finally:
        buf.close()


def router_release(spec: NodeSpec, slots: list[int], tag: int) -> int:
    buf = attach_buffer(spec)
    try:
        return buf.release(slots, tag)
    finally:
        buf.close()


# ---------------------------------------------------------------------- the cases
def test_decodes_preempted_after_their_load_recompute_never_stale(
    nodes: dict[int, NodeSpec], instance: Any
) -> None:
    de = nodes[DE]
    start = free_slots(de)
    # two decodes whose prompts and outputs do not fit the paged cache together: one is
    # preempted while the other decodes, and resumes once it finished
    inst = instance(DE, num_blocks=9)
    for i, n in enumerate((100, 110)):
        toks = prompt(i, n)
        slots = lease(de, toks, tag=100 + i)
        inst.add(f"r{i}", toks, 60, decode_params(de, toks, slots, 100 + i))
    inst.run()
    assert inst.num_preempted > 0
    assert sorted(r for r, _ in inst.loaded_blocks) == ["r0", "r1"]  # each loaded once
    settle(de)
    assert free_slots(de) == start  # prompt slots persisted or freed, generated ones written


def test_abort_before_the_load_returns_the_lease(nodes: dict[int, NodeSpec], instance: Any) -> None:
    de = nodes[DE]
    start = free_slots(de)
    inst = instance(DE, num_blocks=64, max_seqs=1)  # one at a time: the second one waits
    toks0, toks1 = prompt(0, 90), prompt(1, 70)
    s0, s1 = lease(de, toks0, 200), lease(de, toks1, 201)
    inst.add("a", toks0, 4, decode_params(de, toks0, s0, 200))
    inst.add("b", toks1, 4, decode_params(de, toks1, s1, 201))
    inst.step()  # "a" loads (its slots are the instance's now), "b" waits
    assert [r for r, _ in inst.loaded_blocks] == ["a"]
    assert router_release(de, s0, 200) == 0  # the router cannot take back what was claimed
    held = start - free_slots(de)
    inst.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # before its load
    assert start - free_slots(de) <= held - len(s1)  # "b"'s lease is back at once
    inst.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # after its load
    inst.run()
    settle(de)
    assert free_slots(de) == start


def test_a_lease_taken_back_before_the_load_is_recomputed(
    nodes: dict[int, NodeSpec], instance: Any
) -> None:
    de = nodes[DE]
    start = free_slots(de)
    inst = instance(DE, num_blocks=64)
    toks = prompt(3, 120)
    slots = lease(de, toks, 300)
    inst.add("c", toks, 5, decode_params(de, toks, slots, 300))
    assert router_release(de, slots, 300) == len(slots)  # the client left: router's exit
    inst.run()  # the load is lost, its blocks reported as load errors: vLLM recomputes them
    assert inst.lost == ["c"] and not inst.loaded_blocks
    settle(de)
    assert free_slots(de) == start


def test_chunked_prefill_loads_once_and_saves_every_block(
    nodes: dict[int, NodeSpec], instance: Any
) -> None:
    pe, de = nodes[PE], nodes[DE]
    inst = instance(PE, num_blocks=10, max_batched=64)  # 64-token chunks
    pe_buf, de_buf = attach_buffer(pe), attach_buffer(de)
    try:
        jobs = []
        for i, (n, hit) in enumerate(((200, 96), (230, 64))):
            toks = prompt(10 + i, n)
            hit_slots = pe_buf.alloc(hit // BS)
            de_slots = de_buf.alloc(-(-n // BS))
            assert hit_slots is not None and de_slots is not None
            fill_slots(pe, toks, hit_slots)
            params = TransferParams(
                load=BlockLoad(PE, tuple(hit_slots), hit), save=BlockSave(DE, tuple(de_slots), 0)
            )
            inst.add(f"p{i}", toks, 1, params)
            jobs.append((toks, de_slots))
        inst.run()
        assert inst.num_steps >= 4  # (200 - 96) + (230 - 64) tokens in chunks of 64
        assert sorted(r for r, _ in inst.loaded_blocks) == ["p0", "p1"]  # once each
        for toks, de_slots in jobs:  # the DE buffer holds every block's true KV
            for i, slot in enumerate(de_slots):
                raw = bytearray(de_buf.slot(slot))
                view = torch.frombuffer(raw, dtype=torch.float32).view(LAYERS, BS, -1)
                for off in range(min(BS, len(toks) - i * BS)):
                    pos = i * BS + off
                    assert float(view[1, off, 0]) == kv_value(toks[pos], pos, 1)
    finally:
        pe_buf.close()
        de_buf.close()


def test_a_layout_the_connector_does_not_handle_is_refused_when_vllm_builds_it(
    nodes: dict[int, NodeSpec],
) -> None:
    """A KV cache group of a kind the connector has no copy for: refused, one line naming
    it (fp8 caches, MLA, TP, PP and sliding windows are served: test_vllm_shapes.py)."""
    with pytest.raises(
        ValueError, match=r"^DualPathConnector: KV cache group 0 .* is ChunkedLocalAttentionSpec"
    ):
        Instance(nodes, DE, num_blocks=16, local_chunk=64)
