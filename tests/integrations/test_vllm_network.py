"""Side-cars as nodes of a cluster, on loopback: slots allocated over TCP, KV pushed from one
node's buffer into another's by Mooncake Transfer Engine (``sidecar.push``), the router's flow
over them. The same processes run in network namespaces in ``test_vllm_cluster.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integrations.nodes import running_sidecars

from dualpath.integrations.vllm.cnic import _runs
from dualpath.integrations.vllm.node import NodeSpec, RemoteSlots, attach_buffer, call

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda is not installed")

LAYERS, BS, ROW = 2, 32, 64


@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[dict[int, NodeSpec]]:
    with running_sidecars(tmp_path, 12, LAYERS, BS, ROW, "ns0", networked=True) as specs:
        yield specs


def test_consecutive_slots_on_both_sides_move_in_one_write() -> None:
    assert _runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert _runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert _runs([], []) == []


def test_slots_are_leased_over_tcp_and_kv_pushed_between_nodes(
    nodes: dict[int, NodeSpec],
) -> None:
    pe, de = RemoteSlots(nodes[0]), RemoteSlots(nodes[1])
    assert nodes[0].control.startswith("tcp://127.0.0.1:")
    src = de.alloc(5, owner=7)
    dst = pe.alloc(5, owner=7)
    assert src is not None and dst is not None and pe.num_free == 12 - 5
    block = nodes[0].layout.full_block_bytes
    de_buf, pe_buf = attach_buffer(nodes[1]), attach_buffer(nodes[0])
    try:
        stride = de_buf.spec.stride_bytes
        for i, s in enumerate(src):  # distinct bytes per block
            de_buf.data[s * stride : s * stride + block] = bytes([i + 1]) * block
        # out of order on the receiving side: runs split where either side jumps
        order = [dst[4], dst[0], dst[1], dst[2], dst[3]]
        got = call(
            nodes[1].control,
            {"op": "push", "slots": src, "to": nodes[0].control, "to_slots": order},
        )
        assert got["bytes"] == 5 * block
        for i, d in enumerate(order):
            assert bytes(pe_buf.data[d * stride : d * stride + block]) == bytes([i + 1]) * block
        assert call(nodes[1].control, {"op": "stats"})["bytes_pushed"] == 5 * block
    finally:
        de_buf.close()
        pe_buf.close()
    assert pe.release(dst, owner=8) == 0  # not its lease: nothing freed
    assert pe.release(dst, owner=7) == 5 and de.release(src, owner=7) == 5
    assert pe.num_free == 12 and de.num_free == 12


def test_a_push_to_a_node_that_is_gone_is_a_clean_error(nodes: dict[int, NodeSpec]) -> None:
    slots = RemoteSlots(nodes[1]).alloc(1, owner=1)
    assert slots is not None
    with pytest.raises((OSError, ValueError)):
        call(
            nodes[1].control,
            {"op": "push", "slots": slots, "to": "tcp://127.0.0.1:1", "to_slots": [0]},
            timeout_s=20,
        )
    with pytest.raises(ValueError, match="3 peer slots"):
        call(
            nodes[1].control,
            {"op": "push", "slots": slots, "to": nodes[0].control, "to_slots": [0, 1, 2]},
        )
    assert RemoteSlots(nodes[1]).release(slots, owner=1) == 1


def test_a_prefill_node_persists_a_leases_slots_only_while_they_are_its(
    nodes: dict[int, NodeSpec], tmp_path: Path
) -> None:
    """The prompt's new blocks written through the PE node's SNIC (``write`` with the
    router's lease, ``policy.side.SideRule.write_node``): all of the lease's slots or none;
    each slot freed once its block is durable, the bytes in the store exactly the slot's."""
    from dualpath.kv.stores import open_store

    pe = RemoteSlots(nodes[0])
    slots = pe.alloc(3, owner=7)
    assert slots is not None
    block = nodes[0].layout.full_block_bytes
    buf = attach_buffer(nodes[0])
    try:
        stride = buf.spec.stride_bytes
        for i, s in enumerate(slots):
            buf.data[s * stride : s * stride + block] = bytes([40 + i]) * block
    finally:
        buf.close()
    keys = [f"{i:064x}" for i in range(1, 4)]
    op = {"op": "write", "keys": keys, "slots": slots}
    # another lease's slots (this one given up on, its slots taken since): nothing is queued
    assert call(nodes[0].control, {**op, "owner": 8})["queued"] == 0
    assert pe.num_free == 12 - 3
    assert call(nodes[0].control, {**op, "owner": 7})["queued"] == 3
    # durable, then freed: settle waits for exactly these writes
    answer = call(nodes[0].control, {"op": "settle", "keys": keys, "timeout_s": 30})
    assert answer == {"waited": answer["waited"], "pending": 0}
    assert pe.num_free == 12
    assert pe.release(slots, owner=7) == 0  # the lease no longer holds them: nothing to free
    store = open_store(str(tmp_path / "kv"), nodes[0].layout, nodes[0].store_namespace)
    for i, key in enumerate(keys):
        got = bytearray(block)
        store.read_block(key, memoryview(got))
        assert bytes(got) == bytes([40 + i]) * block


def test_an_alloc_on_a_full_node_waits_until_another_process_frees_slots(
    nodes: dict[int, NodeSpec],
) -> None:
    """A networked node's side-car holds an ``alloc`` with ``wait_s`` while its buffer is
    full, and answers it as soon as a process of the node frees slots (an instance after a
    load rings the buffer's doorbell): its router, across the network, cannot hear that."""
    import threading

    de = RemoteSlots(nodes[1])
    hog = de.alloc(12, owner=9)  # the buffer full
    assert hog is not None
    assert de.alloc(2, owner=7, wait_s=0.1) is None  # nothing freed within its wait
    got: list[list[int] | None] = []
    waiter = threading.Thread(target=lambda: got.append(de.alloc(2, owner=7, wait_s=25.0)))
    waiter.start()
    instance = attach_buffer(nodes[1])  # as a decode instance's worker attaches it
    try:
        waiter.join(0.3)
        assert waiter.is_alive() and not got  # waiting in the side-car
        assert instance.release(hog[:3], 9) == 3  # rings the doorbell
        waiter.join(20)
        assert got and got[0] is not None and sorted(got[0]) == sorted(hog[:2])
    finally:
        instance.close()
    de.release(hog[3:], 9)
    de.release(got[0] or [], 7)
    assert de.num_free == 12
    with pytest.raises(ValueError, match=r"wait_s=-1 is invalid"):
        call(nodes[1].control, {"op": "alloc", "num_slots": 1, "owner": 7, "wait_s": -1})


def _layer_report(to: str, layer: int, part: str, parts: int, job: str, slots, to_slots):  # type: ignore[no-untyped-def]
    entry = {"job": job, "slots": slots, "to": to, "to_slots": to_slots}
    return {"op": "push_layer", "layer": layer, "part": part, "parts": parts, "jobs": [entry]}


def test_a_layerwise_hand_over_pushes_each_layer_once_all_its_writers_reported(
    nodes: dict[int, NodeSpec],
) -> None:
    """The PE node's side-car pushes layer l of a prefill's slots to the DE buffer as soon as
    every writer of l (two tensor-parallel ranks here) reported it; the router's ``handed``
    waits for the transfers and names the slots not wholly there (a layer never reported),
    and a report of a closed hand-over is dropped: it never writes into slots given back."""
    pe, de = RemoteSlots(nodes[0]), RemoteSlots(nodes[1])
    src, dst = pe.alloc(3, owner=7), de.alloc(3, owner=7)
    assert src is not None and dst is not None
    layout = nodes[0].layout
    layer_bytes, block = layout.layer_block_bytes, layout.full_block_bytes
    pe_buf, de_buf = attach_buffer(nodes[0]), attach_buffer(nodes[1])
    to = nodes[1].control

    def layer_of(buf, slot: int, layer: int) -> bytes:  # type: ignore[no-untyped-def]
        at = slot * buf.spec.stride_bytes + layout.layer_offset(layer)
        return bytes(buf.data[at : at + layer_bytes])

    try:
        stride = pe_buf.spec.stride_bytes
        for i, s in enumerate(src):  # layer l of block i: bytes 10 * i + l + 1
            for layer in range(LAYERS):
                at = s * stride + layout.layer_offset(layer)
                pe_buf.data[at : at + layer_bytes] = bytes([10 * i + layer + 1]) * layer_bytes
        for d in dst:
            de_buf.data[d * stride : d * stride + block] = bytes(block)
        report = _layer_report(to, 0, "0.0", 2, "b:1", src, dst)
        assert call(nodes[0].control, report)["submitted"] == 0  # one writer of two so far
        assert call(nodes[0].control, {**report, "part": "0.1"})["submitted"] == 1
        # layer 1 only for the first two slots: the third is missing that layer
        for part in ("0.0", "0.1"):
            r1 = _layer_report(to, 1, part, 2, "b:1", src[:2], dst[:2])
            call(nodes[0].control, r1)
        answer = call(nodes[0].control, {"op": "handed", "job": "b:1", "slots": src})
        assert answer["missing"] == [2]
        for i, d in enumerate(dst):
            assert layer_of(de_buf, d, 0) == bytes([10 * i + 1]) * layer_bytes
        for i, d in enumerate(dst[:2]):
            assert layer_of(de_buf, d, 1) == bytes([10 * i + 2]) * layer_bytes
        assert layer_of(de_buf, dst[2], 1) == bytes(layer_bytes)
        # closed: a late report (a step still running) is dropped, nothing lands
        late = _layer_report(to, 1, "0.0", 1, "b:1", src[2:], dst[2:])
        assert call(nodes[0].control, late)["submitted"] == 0
        assert layer_of(de_buf, dst[2], 1) == bytes(layer_bytes)
        stats = call(nodes[0].control, {"op": "stats"})
        assert stats["bytes_forwarded"] == 5 * layer_bytes
        assert stats["forward_reports_dropped"] == 1 and stats["forwards_open"] == 0
        # a hand-over nothing was reported for: every slot to be pushed whole
        none = call(nodes[0].control, {"op": "handed", "job": "b:2", "slots": src})
        assert none["missing"] == [0, 1, 2]
        with pytest.raises(ValueError, match="layer=2 is invalid"):
            call(nodes[0].control, _layer_report(to, 2, "0.0", 1, "b:3", src, dst))
    finally:
        pe_buf.close()
        de_buf.close()
    assert pe.release(src, owner=7) == 3 and de.release(dst, owner=7) == 3
