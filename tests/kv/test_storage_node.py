"""The storage-node core both shells run (``kv.storage_node.StorageNode``), on a real file store
and a real node buffer: reads FIFO with their readable prefix, writes on a thread of their own,
``settle``, the write-failure policy, the read-queue counters, the stop."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.storage_node import (
    READ_JOBS_IN_FLIGHT,
    ReadDone,
    StorageNode,
    WriteOutcome,
)
from dualpath.kv.store import HEADER_BYTES, QUARANTINE, BlockLayout, KVStore
from dualpath.kv.tier import DramTier
from dualpath.kv.worker import FailingWrites

LAYOUT = BlockLayout(num_layers=2, block_tokens=4, row_bytes=1024)  # 8 KiB: FailingWrites fails it
BLOCK = LAYOUT.full_block_bytes
WAIT_S = 10.0  # a bound on waits for another thread, never a speed assertion


def _key(i: int) -> str:
    return f"{i:02x}" + "0" * 30


def _payload(fill: int) -> bytes:
    return bytes((fill + i) % 256 for i in range(BLOCK))


class GatedStore(KVStore):
    """A file store whose block reads and writes each wait for their gate (open by default)."""

    def __init__(self, root: Path, **kw: Any) -> None:
        super().__init__(root, LAYOUT, namespace="node-io", **kw)
        self.reads_open, self.writes_open = threading.Event(), threading.Event()
        self.reads_open.set()
        self.writes_open.set()
        self.reading = threading.Event()  # a read has reached the store
        self.closed = False

    def read_block(self, key: str, out: memoryview) -> None:
        self.reading.set()
        assert self.reads_open.wait(WAIT_S)
        super().read_block(key, out)

    def write_block(self, key: str, payload: memoryview | bytes) -> bool:
        assert self.writes_open.wait(WAIT_S)
        return super().write_block(key, payload)

    def close(self) -> None:
        self.closed = True


class BatchedStore(GatedStore):
    batched = True  # read_blocks / write_blocks: one call for many blocks


class Written:
    """``on_written``'s calls, in order, and an event per key."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, WriteOutcome]] = []
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def __call__(self, key: str, slot: int, outcome: WriteOutcome) -> None:
        with self._lock:
            self.calls.append((key, slot, outcome))
        self._event(key).set()

    def wait(self, key: str) -> WriteOutcome:
        assert self._event(key).wait(WAIT_S), key
        with self._lock:
            return [o for k, _, o in self.calls if k == key][-1]


@pytest.fixture
def buffer() -> Iterator[SlotBuffer]:
    buf = SlotBuffer.create(BufferSpec(f"dpt-{uuid.uuid4().hex[:12]}", 8, BLOCK), threading.Lock())
    try:
        yield buf
    finally:
        buf.close()


@contextlib.contextmanager
def running(node: StorageNode) -> Iterator[StorageNode]:
    node.start()
    try:
        yield node
    finally:
        node.stop(drop_reads=True, timeout_s=WAIT_S)


def _result(done: Future[ReadDone]) -> ReadDone:
    return done.result(timeout=WAIT_S)


def test_reads_run_in_order_and_end_at_the_first_missing_or_corrupt_block(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    store = GatedStore(tmp_path)
    for i in (0, 1, 3, 4):
        assert store.write_block(_key(i), _payload(i))
    corrupt = store.path(_key(4))
    with open(corrupt, "r+b") as f:  # one payload byte flipped: the checksum fails
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([_payload(4)[5] ^ 0xFF]))
    started: list[int] = []
    node = StorageNode("node0", store, buffer, on_read_started=started.append)
    with running(node):
        store.reads_open.clear()  # the first read holds the reader: the others queue behind
        first = node.read([_key(0), _key(1), _key(2), _key(3)], [0, 1, 2, 3], tag=7)
        assert store.reading.wait(WAIT_S)
        second = node.read([_key(3), _key(4)], [4, 5], tag=8)
        third = node.read([_key(1)], [6], tag=9)
        store.reads_open.set()
        got = [_result(f) for f in (first, second, third)]
    assert started == [7, 8, 9]  # FIFO
    assert [g.num_ok for g in got] == [2, 1, 1]  # block 2 missing, block 4 corrupt
    assert all(g.num_from_tier == 0 and g.started_s <= g.done_s for g in got)
    assert bytes(buffer.slot(0)) == _payload(0) and bytes(buffer.slot(1)) == _payload(1)
    assert bytes(buffer.slot(6)) == _payload(1)
    assert not corrupt.exists()  # removed: the recomputed block gets persisted again
    assert node.counters()["bytes_read"] == 4 * BLOCK


def test_a_write_does_not_wait_behind_a_read_in_progress(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    store = GatedStore(tmp_path)
    assert store.write_block(_key(0), _payload(0))
    written = Written()
    node = StorageNode("node0", store, buffer, on_written=written)
    with running(node):
        store.reads_open.clear()
        read = node.read([_key(0)], [0])
        assert store.reading.wait(WAIT_S)  # the reader is inside the store, held there
        buffer.slot(1)[:] = _payload(9)
        node.write([(_key(9), 1)])
        assert written.wait(_key(9)) is WriteOutcome.STORED  # while the read still waits
        assert not read.done()
        store.reads_open.set()
        assert _result(read).num_ok == 1
    out = memoryview(bytearray(BLOCK))
    store.read_block(_key(9), out)
    assert out == _payload(9)
    assert written.calls == [(_key(9), 1, WriteOutcome.STORED)]


def test_settle_waits_for_pending_keys_and_gives_up_at_its_timeout(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    store = GatedStore(tmp_path)
    node = StorageNode("node0", store, buffer)
    with running(node):
        assert node.pending.settle([_key(1)], 0.0) == node.pending.settle(
            [], 5.0
        )  # nothing pending
        assert not node.pending.settle([_key(1)], 0.0).waited
        store.writes_open.clear()
        buffer.slot(0)[:] = _payload(1)
        node.write([(_key(1), 0)])
        node.pending.add([_key(2)])  # e.g. a persist job whose parts are still coming
        held = node.pending.settle([_key(1), _key(2), _key(3)], 0.05)
        assert held.waited and held.pending == 2  # timed out with both still pending
        assert node.counters()["unfinished_writes"] == 2
        store.writes_open.set()
        done = node.pending.settle([_key(1)], WAIT_S)
        assert done.waited and done.pending == 0
        assert store.has(_key(1))  # pending until durable
        threading.Timer(0.05, node.pending.drop, args=([_key(2)],)).start()
        assert node.pending.settle([_key(2)], WAIT_S).pending == 0
        assert node.counters()["unfinished_writes"] == 0
        for bad in (-1.0, float("nan"), float("inf"), "1"):
            with pytest.raises(ValueError, match="timeout_s"):
                node.pending.settle([_key(1)], bad)  # type: ignore[arg-type]


def test_a_failing_write_is_counted_and_a_path_error_not_tried_again(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    fault = FailingWrites(-1, errno.EACCES)  # every payload write refused: a path error
    store = GatedStore(tmp_path, write_fn=fault)
    written = Written()
    node = StorageNode("node0", store, buffer, on_written=written)
    with running(node):
        node.write([(_key(5), 0)])
        assert written.wait(_key(5)) is WriteOutcome.DROPPED
        assert fault.attempts == 1  # not retried
        node.write([(_key(5), 1)])
        assert node.pending.settle([_key(5)], WAIT_S).pending == 0
    assert written.calls == [(_key(5), 0, WriteOutcome.DROPPED), (_key(5), 1, WriteOutcome.DROPPED)]
    assert fault.attempts == 1  # the second dropped unread: its path stayed in the way
    stats = node.counters()
    assert stats["failed_writes"] == 2 and stats["bytes_written"] == 0
    assert not store.has(_key(5)) and list(tmp_path.rglob("*.tmp")) == []


def test_a_block_in_the_way_of_its_folder_is_dropped_and_its_slot_handed_back(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    (tmp_path / _key(6)[:2]).write_text("a file where the block's folder goes")
    (tmp_path / QUARANTINE).write_text("and one where it would be moved aside")
    written = Written()
    node = StorageNode("node0", GatedStore(tmp_path), buffer, on_written=written)
    with running(node):
        node.write([(_key(6), 3)])
        assert written.wait(_key(6)) is WriteOutcome.DROPPED
    assert written.calls == [(_key(6), 3, WriteOutcome.DROPPED)]
    assert node.failures.num_failed == 1 and node.failures.skip(_key(6))


def test_a_stored_block_is_skipped_only_where_asked(tmp_path: Path, buffer: SlotBuffer) -> None:
    store = GatedStore(tmp_path)
    assert store.write_block(_key(1), _payload(1))
    for skip_stored, outcome in ((True, WriteOutcome.PRESENT), (False, WriteOutcome.STORED)):
        written = Written()
        node = StorageNode("n", store, buffer, skip_stored=skip_stored, on_written=written)
        with running(node):
            node.write([(_key(1), 0)])
            assert written.wait(_key(1)) is outcome
        stats = node.counters()
        assert stats["skipped_writes"] == int(skip_stored)
        assert stats["bytes_written"] == (0 if skip_stored else BLOCK)


def test_the_read_queue_counts_waiting_and_in_flight_and_returns_to_zero(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    store = GatedStore(tmp_path)
    for i in range(3):
        assert store.write_block(_key(i), _payload(i))
    node = StorageNode("node0", store, buffer)
    with running(node):
        store.reads_open.clear()
        first = node.read([_key(0), _key(1)], [0, 1])
        assert store.reading.wait(WAIT_S)
        second = node.read([_key(2)], [2])
        stats = node.counters()
        assert (stats["read_requests_in_flight"], stats["read_bytes_in_flight"]) == (1, 2 * BLOCK)
        assert (stats["read_requests_waiting"], stats["read_bytes_waiting"]) == (1, BLOCK)
        store.reads_open.set()
        assert _result(first).num_ok == 2 and _result(second).num_ok == 1
        stats = node.counters()
    for name in (
        "read_requests_waiting",
        "read_bytes_waiting",
        "read_requests_in_flight",
        "read_bytes_in_flight",
        "unfinished_writes",
        "pending_writes",
    ):
        assert stats[name] == 0, name
    assert stats["bytes_read"] == 3 * BLOCK
    assert stats["read_queued_s"] >= 0 and stats["read_store_s"] > 0
    assert stats["read_busy_s"] == stats["write_busy_s"] == 0.0  # unpaced


@pytest.mark.parametrize("drop_reads", [True, False])
def test_stop_drops_or_drains_reads_not_started_and_lands_every_queued_write(
    tmp_path: Path, buffer: SlotBuffer, drop_reads: bool
) -> None:
    store = GatedStore(tmp_path)
    assert store.write_block(_key(0), _payload(0))
    written = Written()
    node = StorageNode("node0", store, buffer, on_written=written)
    node.start()
    store.reads_open.clear()
    store.writes_open.clear()
    started = node.read([_key(0)], [0])
    assert store.reading.wait(WAIT_S)
    queued = node.read([_key(0)], [1])
    for i in (1, 2):
        buffer.slot(1 + i)[:] = _payload(i)
    node.write([(_key(1), 2), (_key(2), 3)])
    stopping = threading.Thread(target=node.stop, args=(drop_reads, WAIT_S))
    stopping.start()
    if drop_reads:
        deadline = time.monotonic() + WAIT_S
        while not queued.done():  # the stop cancels it before it waits for the threads
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert queued.cancelled()
    store.reads_open.set()
    store.writes_open.set()
    stopping.join(WAIT_S)
    assert not stopping.is_alive()
    assert _result(started).num_ok == 1
    if not drop_reads:
        assert _result(queued).num_ok == 1
    assert [c[2] for c in written.calls] == [WriteOutcome.STORED] * 2
    assert store.has(_key(1)) and store.has(_key(2))
    stats = node.counters()
    assert stats["read_requests_waiting"] == stats["unfinished_writes"] == 0


def test_a_batched_store_reads_and_writes_through_clients_of_its_own(
    tmp_path: Path, buffer: SlotBuffer
) -> None:
    store = BatchedStore(tmp_path)
    clients: list[BatchedStore] = []

    def open_client() -> BatchedStore:
        clients.append(BatchedStore(tmp_path))
        return clients[-1]

    for i in (0, 2):
        assert store.write_block(_key(i), _payload(i))
    with open(store.path(_key(2)), "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(b"\xff\xfe")
    written = Written()
    node = StorageNode("node0", store, buffer, open_client=open_client, on_written=written)
    assert node.batched and node.num_readers == READ_JOBS_IN_FLIGHT
    with running(node):
        assert len(clients) == READ_JOBS_IN_FLIGHT  # the extra readers' and the writer's
        reads = [node.read([_key(0), _key(2)], [0, 1]) for _ in range(READ_JOBS_IN_FLIGHT)]
        assert [_result(r).num_ok for r in reads] == [1] * READ_JOBS_IN_FLIGHT
        for i in (4, 5):
            buffer.slot(i)[:] = _payload(i)
        node.write([(_key(4), 4), (_key(5), 5), (_key(0), 6)])
        assert node.pending.settle([_key(4), _key(5), _key(0)], WAIT_S).pending == 0
    assert not store.path(_key(2)).exists()  # corrupt: removed
    assert [c[2] for c in written.calls] == [
        WriteOutcome.STORED,
        WriteOutcome.STORED,
        WriteOutcome.PRESENT,
    ]
    assert all(c.closed for c in clients) and not store.closed  # the caller's store is its own
    assert node.counters()["skipped_writes"] == 1


def test_a_tier_serves_what_was_read_or_kept(tmp_path: Path, buffer: SlotBuffer) -> None:
    store = GatedStore(tmp_path)
    for i in (0, 1):
        assert store.write_block(_key(i), _payload(i))
    tier = DramTier(4 * BLOCK)
    node = StorageNode("node0", store, buffer, tier=tier)
    assert not node.batched
    with running(node):
        assert _result(node.read([_key(0)], [0])).num_from_tier == 0
        node.keep(_key(1))  # a block its node's PE computed: copied in behind the reads
        deadline = time.monotonic() + WAIT_S
        while _key(1) not in tier:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.remove(store.path(_key(0)))
        os.remove(store.path(_key(1)))
        again = _result(node.read([_key(0), _key(1)], [2, 3]))
    assert (again.num_ok, again.num_from_tier) == (2, 2)
    assert bytes(buffer.slot(3)) == _payload(1)
    with pytest.raises(ValueError, match="no DRAM tier"):
        StorageNode("node1", store, buffer).keep(_key(0))
