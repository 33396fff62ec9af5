"""The connector's worker half and the node side-car, without vLLM: real side-car processes,
real shared-memory buffers, a real file-backed store, paged KV tensors of vLLM's CPU shape."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.integrations.nodes import running_sidecars  # noqa: E402

from dualpath.integrations.vllm.blocks import PagedLayout  # noqa: E402
from dualpath.integrations.vllm.node import (  # noqa: E402
    BufferOwners,
    NodeSpec,
    attach_buffer,
    call,
    instance_owner,
    wait_ready,
)
from dualpath.integrations.vllm.params import (  # noqa: E402
    BlockForward,
    BlockLoad,
    BlockPersist,
    BlockSave,
    TransferParams,
)
from dualpath.integrations.vllm.plan import StepPlanner  # noqa: E402
from dualpath.integrations.vllm.worker import Rank, WorkerSide  # noqa: E402
from dualpath.kv.store import KVStore, block_keys  # noqa: E402

BS, LAYERS, HEADS, C = 32, 3, 2, 16  # vLLM CPU: kv_layer is [blocks, kv heads, block, 2·head_dim]
ROW = 2 * HEADS * (C // 2) * 2  # K and V of every head, bfloat16


def _caches(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, HEADS, BS, C, generator=g).to(
            torch.bfloat16
        )
        for i in range(LAYERS)
    }


@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[dict[int, NodeSpec]]:
    with running_sidecars(tmp_path, 16, LAYERS, BS, ROW, "ns0") as specs:
        yield specs


def _run_layers(worker: WorkerSide, caches: dict[str, torch.Tensor]) -> None:
    for name, kv in caches.items():  # as vLLM's attention layers do, in order
        worker.wait_for_layer(name)
        worker.save_layer(name, kv)
    worker.end_step()


def test_layout_of_vllm_caches_matches_the_slot() -> None:
    lay = PagedLayout.of(_caches(2, 0), BS)
    assert lay.layer_names[0].startswith("model.layers.0.")
    assert lay.store_layout().full_block_bytes == LAYERS * BS * ROW
    with pytest.raises(ValueError, match="differs"):
        PagedLayout.of(
            {
                "model.layers.0.a": torch.zeros(2, 2, BS, C),
                "model.layers.1.a": torch.zeros(2, 2, BS, C + 2),
            },
            BS,
        )


def test_prefill_to_decode_through_both_buffers_and_the_store(nodes: dict[int, NodeSpec]) -> None:
    """A prefill saves 3 blocks per layer into the DE buffer; a decode loads them into other
    paged blocks and persists the 2 full ones; the store then serves them to a new prefill
    through the PE side-car, byte for byte."""
    tokens = list(range(3 * BS - 5))  # 2 full blocks and a partial one
    pe, de = attach_buffer(nodes[0]), attach_buffer(nodes[1])
    try:
        de_slots = de.alloc(3)
        assert de_slots is not None
        src = _caches(8, seed=1)
        prefill = WorkerSide(nodes, 0, BS)
        prefill.register(src)
        plan_p = StepPlanner(BS)
        params = TransferParams(save=BlockSave(1, tuple(de_slots), 0))
        plan_p.matched_tokens("a", params, tokens, len(tokens), 0)
        prefill.start_step(plan_p.step([("a", [5, 2, 7], 0, len(tokens))], []))
        _run_layers(prefill, src)
        assert prefill.counters.bytes_by_path["pe_hbm_to_de_buffer"] == 3 * LAYERS * BS * ROW

        dst = {k: torch.zeros_like(v) for k, v in _caches(8, seed=2).items()}
        decode = WorkerSide(nodes, 1, BS)
        decode.register(dst)
        owners = BufferOwners(nodes, instance_owner(1))
        plan_d = StepPlanner(BS, owners)  # as the connector's
        dparams = TransferParams(
            load=BlockLoad(1, tuple(de_slots), len(tokens)), persist=BlockPersist(1, 0, "tenant-ns")
        )
        assert plan_d.matched_tokens("a", dparams, tokens, len(tokens), 0) == len(tokens) - 1
        plan_d.allocated("a", len(tokens) - 1)
        decode.start_step(plan_d.step([("a", [1, 3, 4], len(tokens) - 1, 1)], []))
        _run_layers(decode, dst)
        for name in src:
            for s, d in ((5, 1), (2, 3), (7, 4)):
                assert torch.equal(src[name][s], dst[name][d])
        keys = block_keys(tokens, BS, "tenant-ns")
        assert len(keys) == 2

        def stored() -> int:
            return int(call(nodes[1].socket_path, {"op": "stats"})["bytes_written"])

        for _ in range(200):  # the side-car writes in the background
            if stored() == 2 * LAYERS * BS * ROW:
                break
            import time

            time.sleep(0.05)
        assert stored() == 2 * LAYERS * BS * ROW
        assert de.num_free == 16  # the persisted slots were freed by the side-car, the rest by us

        pe_slots = pe.alloc(2)
        assert pe_slots is not None
        got = call(nodes[0].socket_path, {"op": "read", "keys": keys, "slots": pe_slots})
        assert got["num_ok"] == 2
        again = {k: torch.zeros_like(v) for k, v in dst.items()}
        prefill2 = WorkerSide(nodes, 0, BS)
        prefill2.register(again)
        plan2 = StepPlanner(BS)
        p2 = TransferParams(load=BlockLoad(0, tuple(pe_slots), 2 * BS))
        assert plan2.matched_tokens("b", p2, tokens, len(tokens), 0) == 2 * BS
        plan2.allocated("b", 2 * BS)
        # (paged block 0 is vLLM's null block: never a request's)
        prefill2.start_step(plan2.step([("b", [6, 7, 2], 2 * BS, len(tokens) - 2 * BS)], []))
        _run_layers(prefill2, again)
        for name in src:
            assert torch.equal(again[name][6], src[name][5])
            assert torch.equal(again[name][7], src[name][2])
        assert prefill2.counters.bytes_by_path["pe_buffer_to_pe_hbm"] == 2 * LAYERS * BS * ROW
        # a missing block ends the readable prefix
        miss = call(
            nodes[0].socket_path, {"op": "read", "keys": ["00" * 16, keys[1]], "slots": pe_slots}
        )
        assert miss["num_ok"] == 0
        pe.free(pe_slots)
        for w in (prefill, decode, prefill2):
            w.close()
        owners.close()
    finally:
        pe.close()
        de.close()


def test_a_load_from_an_unknown_slot_is_reported_for_recompute(
    nodes: dict[int, NodeSpec],
) -> None:
    caches = _caches(4, seed=3)
    worker = WorkerSide(nodes, 0, BS)
    worker.register(caches)
    plan = StepPlanner(BS)
    p = TransferParams(load=BlockLoad(0, (999,), BS))  # no such slot
    plan.matched_tokens("c", p, list(range(2 * BS)), 2 * BS, 0)
    plan.allocated("c", BS)
    worker.start_step(plan.step([("c", [3, 1], BS, BS)], []))
    _run_layers(worker, caches)
    assert worker.take_load_errors() == {3}
    assert worker.take_load_errors() == set()
    worker.close()


def test_sidecar_answers_a_bad_op_with_an_error(nodes: dict[int, NodeSpec]) -> None:
    with pytest.raises(ValueError, match="op='nope' is invalid"):
        call(nodes[0].socket_path, {"op": "nope"})
    with pytest.raises(ValueError, match="2 keys for 1 slots"):
        call(nodes[0].socket_path, {"op": "read", "keys": ["a", "b"], "slots": [0]})


def test_settle_waits_for_the_writes_of_its_keys(tmp_path: Path) -> None:
    """Four writes through a slow SNIC (6 KiB blocks at 40 KB/s: ~0.6 s): ``settle`` on the
    last key returns once it is durable (the store then holds all four), at once for a key
    nobody writes; a bad timeout is an error naming it."""
    spec = NodeSpec(
        1,
        "de",
        f"dps{tmp_path.name[-12:]}",
        8,
        str(tmp_path / "1.lock"),
        str(tmp_path / "1.sock"),
        str(tmp_path / "kv"),
        LAYERS,
        BS,
        ROW,
        "ns0",
        snic_bytes_per_s=40e3,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.integrations.vllm.sidecar", spec.to_json()]
    )
    try:
        wait_ready(spec.socket_path, timeout_s=30)
        de = attach_buffer(spec)
        keys = block_keys(list(range(4 * BS)), BS, "ns-settle")
        slots = de.alloc(len(keys))
        assert slots is not None
        sock = spec.socket_path
        assert call(sock, {"op": "write", "keys": keys, "slots": slots}) == {"queued": 4}
        store = KVStore(spec.kv_root, spec.layout, namespace="ns0")
        assert store.lookup(keys) < 4 * BS  # still on their way
        assert call(sock, {"op": "settle", "keys": keys[-1:], "timeout_s": 30}) == {
            "waited": True,
            "pending": 0,
        }
        assert store.lookup(keys) == 4 * BS
        assert de.num_free == 8  # each slot freed once its block was durable
        idle = call(sock, {"op": "settle", "keys": ["ab" * 16], "timeout_s": 30})
        assert idle == {"waited": False, "pending": 0}
        with pytest.raises(ValueError, match="timeout_s=-1 is invalid"):
            call(sock, {"op": "settle", "keys": keys, "timeout_s": -1})
        de.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _half(caches: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of a TP=2 instance holds of ``caches``: its KV head."""
    return {k: v[:, rank : rank + 1].clone() for k, v in caches.items()}


def test_tensor_parallel_workers_write_and_read_the_canonical_block(
    nodes: dict[int, NodeSpec],
) -> None:
    """Two TP=2 workers (one KV head each) save a prompt's blocks into the DE buffer: the
    slots hold exactly what one TP=1 worker (both heads) saves. A TP=1 decode loads them
    whole, and persists them through the side-car only once both TP=2 workers of a decode
    said they are done with them (``parts``): one part is not enough."""
    tokens = list(range(2 * BS))
    src = _caches(6, seed=5)
    de = attach_buffer(nodes[1])
    try:
        whole_slots, split_slots = de.alloc(2), de.alloc(2)
        assert whole_slots is not None and split_slots is not None
        for slots, workers in (
            (whole_slots, [(WorkerSide(nodes, 0, BS), src)]),
            (
                split_slots,
                [
                    (WorkerSide(nodes, 0, BS, rank=Rank(r, 2, total_heads=HEADS)), _half(src, r))
                    for r in (0, 1)
                ],
            ),
        ):
            params = TransferParams(save=BlockSave(1, tuple(slots), 0))
            for worker, caches in workers:
                worker.register(caches)
                plan = StepPlanner(BS)
                plan.matched_tokens("a", params, tokens, len(tokens), 0)
                worker.start_step(plan.step([("a", [4, 2], 0, len(tokens))], []))
                _run_layers(worker, caches)
                worker.close()
        for a, b in zip(whole_slots, split_slots, strict=True):
            assert bytes(de.slot(a)) == bytes(de.slot(b))

        # a TP=2 decode: each worker loads its head; the persist waits for both parts
        owners = BufferOwners(nodes, instance_owner(1))
        dparams = TransferParams(
            load=BlockLoad(1, tuple(split_slots), len(tokens)), persist=BlockPersist(1, 0, "n")
        )
        plan_d = StepPlanner(BS, owners, job_prefix="tp")
        plan_d.matched_tokens("d", dparams, tokens, len(tokens), 0)
        plan_d.allocated("d", len(tokens) - 1)
        meta = plan_d.step([("d", [1, 3], len(tokens) - 1, 1)], [])
        got = []
        for r in (0, 1):
            dst = {k: torch.zeros_like(v) for k, v in _half(src, r).items()}
            worker = WorkerSide(nodes, 1, BS, rank=Rank(r, 2, total_heads=HEADS))
            worker.register(dst)
            worker.start_step(meta)
            _run_layers(worker, dst)
            got.append(int(call(nodes[1].socket_path, {"op": "stats"})["waiting_jobs"]))
            for name in dst:
                assert torch.equal(dst[name][1], src[name][4, r : r + 1])
                assert torch.equal(dst[name][3], src[name][2, r : r + 1])
            worker.close()
        keys = block_keys(tokens, BS, "n")
        store = KVStore(nodes[1].kv_root, nodes[1].layout, namespace="ns0")
        call(nodes[1].socket_path, {"op": "settle", "keys": keys, "timeout_s": 30})
        assert store.lookup(keys) == 2 * BS  # both parts in: written
        assert got == [1, 0]  # after one part the job waits for the other
        owners.close()
    finally:
        de.close()


def test_each_saved_layer_is_reported_for_the_layerwise_hand_over(
    nodes: dict[int, NodeSpec],
) -> None:
    """Across nodes each TP rank reports every layer it saved of a forwarded save to its
    node's side-car (``push_layer``: its part of the stage's 2 writers), with the blocks the
    step completed and their DE slots, all before the step ends; a partial block waits."""
    tokens = list(range(2 * BS + 5))  # 2 full blocks and a partial one
    forward = BlockForward(1, (40, 41, 42), "boot:3")
    params = TransferParams(save=BlockSave(0, (10, 11, 12), 0, 0, forward))
    pe = attach_buffer(nodes[0])
    try:
        sent: list[tuple[str, dict]] = []  # type: ignore[type-arg]
        for r in (0, 1):

            def record(address: str, op: dict) -> dict:  # type: ignore[type-arg]
                sent.append((address, op))
                return {"submitted": 1}

            worker = WorkerSide(nodes, 0, BS, sidecar=record, rank=Rank(r, 2, total_heads=HEADS))
            caches = _half(_caches(6, seed=2), r)
            worker.register(caches)
            plan = StepPlanner(BS)
            plan.matched_tokens("a", params, tokens, len(tokens), 0)
            worker.start_step(plan.step([("a", [4, 2, 5], 0, 2 * BS + 1)], []))
            _run_layers(worker, caches)
            worker.close()
        ops = [op for _, op in sent]
        assert {a for a, _ in sent} == {nodes[0].control}
        assert sorted((op["layer"], op["part"]) for op in ops) == sorted(
            (layer, f"0.{r}") for layer in range(LAYERS) for r in (0, 1)
        )
        for op in ops:
            assert op["op"] == "push_layer" and op["parts"] == 2
            assert op["jobs"] == [
                {"job": "boot:3", "slots": [10, 11], "to": nodes[1].control, "to_slots": [40, 41]}
            ]
    finally:
        pe.close()


def test_an_mla_latent_is_written_by_one_rank_and_loaded_by_all() -> None:
    """MLA: every TP rank holds the whole latent (``[blocks, 1, N, 576]`` here as 1 head of
    16): rank 0 writes it, rank 1 only loads; a KV head split across ranks that the paged
    KV does not show is an error naming the shape."""
    from dualpath.integrations.vllm.blocks import RankSlice

    r0 = RankSlice.of_rank((1, BS, 16), 0, 2, 1, mla=True)
    r1 = RankSlice.of_rank((1, BS, 16), 1, 2, 1, mla=True)
    assert (r0.writer, r1.writer, r0.heads_dim) == (True, False, None)
    assert Rank(1, 2, total_heads=1, mla=True).num_writers == 1
    assert Rank(1, 2, pp_rank=1, pp_size=2, total_heads=8).num_writers == 4
    assert Rank(0, 4, total_heads=2).num_writers == 2  # 2 heads over 4 ranks: 2 replicas each
    rep = RankSlice.of_rank((1, BS, 16), 3, 4, 2)
    assert (rep.first_head, rep.writer) == (1, False)
    with pytest.raises(ValueError, match="no dimension of 2 heads"):
        RankSlice.of_rank((3, BS, 16), 0, 2, 4)
