"""A storage node's I/O core, shared by the runtime's storage worker and the vLLM side-car: the
read queue and its reader threads, the write queue and its writer thread, the writes it still
owes (``pending.PendingWrites``: ``settle``), the node's byte and read-queue counters. It owns
no process, socket or message: a shell hands it reads and writes and hears back through a
Future (reads) and hooks (writes).

Reads run FIFO on their own thread(s), writes on theirs, over the SNIC's two directions (design
§13.5): the NIC is full duplex, so a block write never waits behind a read (a DualPath decode
node's writes, which the agent's next turn waits for, used to queue behind its reads). A
missing or corrupt block ends a read's readable prefix; a corrupt block is removed, so that
the recomputed block gets persisted again.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.pacer import Pacer, transfer_all
from dualpath.kv.pending import PendingWrites
from dualpath.kv.store import BlockCorrupt, BlockStore, bare
from dualpath.kv.tier import DramTier
from dualpath.kv.worker import WriteFailures, persist_with_retry, read_or_miss
from dualpath.types import TrafficClass

# a block-by-block read: two blocks in flight, so that the SNIC's read direction stays busy
# while a block's file is opened and verified
BLOCKS_IN_FLIGHT = 2
# requests a batched store reads at once: while one waits for the store's RPCs (a replica
# list, ~ms) the others keep the SNIC busy (measured on the one-host cluster, 16 agents ×
# 10 turns at 2 MB/s: DualPath's JCT 97.0 s with 2, 93.7 s with 3, its storage bound 78 s)
READ_JOBS_IN_FLIGHT = 3
WRITE_BATCH = 32  # blocks queued for a batched store written in one batched put, at most


class WriteOutcome(enum.Enum):
    """What became of one queued block write (``StorageNode``'s ``on_written`` hook)."""

    STORED = "stored"  # durable now
    PRESENT = "present"  # stored already (another turn persisted it): not sent again
    DROPPED = "dropped"  # not cached: the store refused it (counted in ``failures``) or a bug


@dataclass(frozen=True, slots=True)
class ReadDone:
    """A read's outcome: ``num_ok`` leading blocks verified in their slots (``num_from_tier``
    of them from the DRAM tier); started and done on the node's clock, seconds."""

    num_ok: int
    num_from_tier: int
    started_s: float
    done_s: float


@dataclass(slots=True)
class ReadStage:
    """Requests and their bytes in one stage of the SNIC's read queue (under the node's lock)."""

    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes

    def take(self, nbytes: int) -> None:
        self.requests -= 1
        self.bytes -= nbytes


@dataclass(slots=True)
class _ReadJob:
    keys: list[str]
    slots: list[int]
    tag: int
    done: Future[ReadDone]
    since_s: float


@dataclass(frozen=True, slots=True)
class _Keep:
    """A block to copy from the store into the DRAM tier (behind the reads queued before)."""

    key: str


def leading_ok(oks: Sequence[bool]) -> int:
    """How many leading entries are True: a read's usable prefix."""
    return oks.index(False) if False in oks else len(oks)


def _report(name: str) -> Callable[[str], None]:
    def on_error(message: str) -> None:
        print(f"dualpath: {name}: {message}", file=sys.stderr, flush=True)

    return on_error


class StorageNode:
    """One node's storage I/O: its store, its buffer's slots and its SNIC (``snic``: the read
    and write pacers, None: unpaced; ``dram``: the node's DRAM link, charged by every block
    that crosses it: reads, writes, the tier's copies; empty: unpaced).

    ``tier``: a DRAM tier in front of the store (``dram-tier``): reads look there first, every
    block read or written is kept. ``open_client``: another client of a batched store, opened
    by ``start`` for each extra reader and for the writer (one client carries out its calls
    one after the other). ``skip_stored``: a block the store holds already is not written
    again. ``on_written(key, slot, outcome)``: called once for every queued write, on the
    writer thread, before ``pending`` lets it go (the slot is the caller's to free).
    ``on_read_started(tag)``: a reader takes a read. ``on_error(message)``: a bug (not a
    missing block, not an I/O error), stderr by default. ``clock``: seconds, the read-queue
    times and ``ReadDone``'s."""

    def __init__(
        self,
        name: str,
        store: BlockStore,
        buffer: SlotBuffer,
        *,
        snic: tuple[Pacer, Pacer] | None = None,
        dram: Sequence[Pacer] = (),
        tier: DramTier | None = None,
        open_client: Callable[[], BlockStore] | None = None,
        skip_stored: bool = False,
        on_written: Callable[[str, int, WriteOutcome], None] | None = None,
        on_read_started: Callable[[int], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name, self.store, self.buffer = name, store, buffer
        self.snic, self.dram, self.tier = snic, list(dram), tier
        self.block_bytes = store.layout.full_block_bytes
        self.skip_stored = skip_stored
        self._open_client = open_client
        self._on_written = on_written or (lambda key, slot, outcome: None)
        self._on_read_started = on_read_started or (lambda tag: None)
        self._on_error = on_error or _report(name)
        self._clock = clock
        self._read_route = [*([] if snic is None else [snic[0]]), *self.dram]
        self._write_route = [*([] if snic is None else [snic[1]]), *self.dram]
        # a store taking many blocks per call (its round trips once per batch, the link kept
        # busy), with no software SNIC pacing them one by one and no tier to look in first
        self.batched = store.batched and snic is None and tier is None
        self.num_readers = READ_JOBS_IN_FLIGHT if self.batched else 1
        self._read_stores: list[BlockStore] = [store] * self.num_readers
        self._write_store = store
        self._clients: list[BlockStore] = []
        self._blocks = ThreadPoolExecutor(BLOCKS_IN_FLIGHT, thread_name_prefix="read")
        self._reads: queue.Queue[_ReadJob | _Keep | None] = queue.Queue()
        self._writes: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self.failures = WriteFailures(name)  # block writes dropped, and why
        self.pending = PendingWrites()  # ``settle`` waits on it; a shell may hold keys there
        self._lock = threading.Lock()
        # the SNIC's read queue (the signal the paper's scheduler decides on, §4): requests and
        # bytes queued for a reader, and those a reader is moving now
        self.read_waiting = ReadStage()
        self.read_in_flight = ReadStage()
        # seconds reads spent queued for a reader and in the store's calls, summed
        self.read_queued_s = 0.0
        self.read_store_s = 0.0
        self.bytes_read = 0
        self.bytes_written = 0
        self.num_skipped_writes = 0  # blocks another turn had persisted already

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Open the extra store clients (a batched store) and start the reader(s) and writer."""
        if self.batched and self._open_client is not None:
            # a store across the network gets a client per reader and one for the writes: one
            # client carries out its transfers one batch after the other, so a turn's few blocks
            # to persist would wait behind seconds of another request's reads (measured: a put
            # of 3 blocks 2.2 s instead of 0.3 s beside a 32-block read on a 2 MB/s SNIC)
            self._clients = [self._open_client() for _ in range(self.num_readers)]
            self._read_stores = [self.store, *self._clients[1:]]
            self._write_store = self._clients[0]
        self._threads = [
            threading.Thread(target=self._read_loop, args=(s,), name=f"reader{i}", daemon=True)
            for i, s in enumerate(self._read_stores)
        ]
        self._threads.append(threading.Thread(target=self._write_loop, name="writer", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, drop_reads: bool, timeout_s: float | None = None) -> None:
        """Stop the threads and close the clients ``start`` opened. ``drop_reads``: reads not
        started are cancelled (nobody waits for them), else carried out first. Writes queued
        before the stop still land (durability)."""
        while drop_reads:
            try:
                item = self._reads.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _ReadJob):
                with self._lock:
                    self.read_waiting.take(len(item.keys) * self.block_bytes)
                item.done.cancel()
        for _ in range(self.num_readers):
            self._reads.put(None)
        self._writes.put(None)
        for t in self._threads:
            t.join(timeout_s)
        self._blocks.shutdown()
        for client in self._clients:
            client.close()

    # ---------------------------------------------------------------- reads
    def read(self, keys: Sequence[str], slots: Sequence[int], tag: int = -1) -> Future[ReadDone]:
        """Queue a read of blocks ``keys`` into ``slots`` (FIFO); its outcome, once a reader
        has done it. ``tag``: the caller's name for it (``on_read_started``)."""
        if len(keys) != len(slots):
            raise ValueError(f"read: {len(keys)} keys for {len(slots)} slots")
        done: Future[ReadDone] = Future()
        with self._lock:
            self.read_waiting.add(len(keys) * self.block_bytes)
        self._reads.put(_ReadJob(list(keys), list(slots), tag, done, self._clock()))
        return done

    def keep(self, key: str) -> None:
        """Copy durable block ``key`` into the DRAM tier, behind the reads queued before (a
        block its node's PE computed: the tier's charge is the node's DRAM, never its SNIC)."""
        if self.tier is None:
            raise ValueError(f"keep: {self.name} has no DRAM tier")
        self._reads.put(_Keep(key))

    def _read_loop(self, store: BlockStore) -> None:
        while (item := self._reads.get()) is not None:
            if isinstance(item, _Keep):
                try:
                    self._keep(item.key)
                except Exception as bug:  # not an I/O error
                    self._on_error(f"read failed: {bug!r}")
                continue
            self._serve(store, item)

    def _serve(self, store: BlockStore, job: _ReadJob) -> None:
        nbytes = len(job.keys) * self.block_bytes
        start = self._clock()
        with self._lock:  # waiting → in flight
            self.read_waiting.take(nbytes)
            self.read_in_flight.add(nbytes)
            self.read_queued_s += start - job.since_s
        self._on_read_started(job.tag)
        try:
            done = self._read_blocks(store, job.keys, job.slots)
        except Exception as err:  # not a missing block: a bug or the disk; the reader lives on
            with self._lock:
                self.read_in_flight.take(nbytes)
            job.done.set_exception(bare(err))  # (its frames would hold views of the buffer)
            return
        num_ok = leading_ok([ok for ok, _ in done])
        from_tier = sum(1 for _, tier in done[:num_ok] if tier)
        end = self._clock()
        with self._lock:
            self.bytes_read += num_ok * self.block_bytes
            self.read_in_flight.take(nbytes)
            self.read_store_s += end - start
        job.done.set_result(ReadDone(num_ok, from_tier, start, end))

    def _read_blocks(
        self, store: BlockStore, keys: list[str], slots: list[int]
    ) -> list[tuple[bool, bool]]:
        """(read and verified, from the tier) of each block."""
        if not self.batched:
            return list(self._blocks.map(self._read_one, keys, slots))
        errs = store.read_blocks(keys, [self.buffer.slot(s) for s in slots])
        for key, err in zip(keys, errs, strict=True):
            if isinstance(err, BlockCorrupt):  # recomputed, then stored again
                with contextlib.suppress(OSError):
                    store.remove(key)
        return [(err is None, False) for err in errs]

    def _read_one(self, key: str, slot: int) -> tuple[bool, bool]:
        out = self.buffer.slot(slot)
        if self.tier is not None and self.tier.get(key, out):  # DRAM → the node's buffer
            transfer_all(self.dram, self.block_bytes, TrafficClass.LOW)
            return True, True
        transfer_all(self._read_route, self.block_bytes, TrafficClass.LOW)
        ok = read_or_miss(self.store, key, out)
        if ok and self.tier is not None:
            self.tier.put(key, out[: self.block_bytes])
        return ok, False

    def _keep(self, key: str) -> None:
        tier = self.tier
        if tier is None or key in tier:  # (``keep`` queues none without a tier)
            return
        block = bytearray(self.block_bytes)
        transfer_all(self.dram, self.block_bytes, TrafficClass.LOW)
        if read_or_miss(self.store, key, memoryview(block)):
            tier.put(key, block)

    # ---------------------------------------------------------------- writes
    def write(self, pairs: Sequence[tuple[str, int]]) -> None:
        """Queue each (key, slot) for a write, in order; its keys are pending until
        ``on_written`` has been called for it (``pending``)."""
        self.pending.add([k for k, _ in pairs])
        for pair in pairs:
            self._writes.put(pair)

    def _write_loop(self) -> None:
        while (first := self._writes.get()) is not None:
            batch = [first]
            while self.batched and len(batch) < WRITE_BATCH:  # what queued meanwhile
                try:
                    more = self._writes.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # the stop: after this batch
                    self._writes.put(None)
                    break
                batch.append(more)
            try:
                if self.batched:  # one existence query and one put, even for one block
                    self._write_batch(batch)
                else:
                    self._write_one(*first)
            finally:
                self.pending.drop([k for k, _ in batch])

    def _write_batch(self, batch: list[tuple[str, int]]) -> None:
        """Several blocks in one batched put (``MooncakeBlockStore.write_blocks``); one that
        failed is tried again alone, with ``persist_with_retry``'s backoff."""
        keys, slots = [k for k, _ in batch], [s for _, s in batch]
        try:
            results = self._write_store.write_blocks(keys, [self.buffer.slot(s) for s in slots])
        except Exception as bug:  # not an I/O error (those come back per block)
            self._on_error(f"persist failed: {bug}")
            for key, slot in batch:
                self._on_written(key, slot, WriteOutcome.DROPPED)
            return
        for (key, slot), res in zip(batch, results, strict=True):
            if isinstance(res, OSError):
                self._write_one(key, slot)
                continue
            with self._lock:
                if res:
                    self.bytes_written += self.block_bytes
                else:
                    self.num_skipped_writes += 1
            self._on_written(key, slot, WriteOutcome.STORED if res else WriteOutcome.PRESENT)

    def _write_one(self, key: str, slot: int) -> None:
        self._on_written(key, slot, self._persist(key, slot))

    def _persist(self, key: str, slot: int) -> WriteOutcome:
        if self.failures.skip(key):  # its path stayed in the way: not tried again
            return WriteOutcome.DROPPED
        try:
            if self.skip_stored and self._write_store.has(key):  # content-addressed: not resent
                with self._lock:
                    self.num_skipped_writes += 1
                return WriteOutcome.PRESENT
            transfer_all(self._write_route, self.block_bytes, TrafficClass.LOW)
            err = persist_with_retry(self._write_store, key, self.buffer.slot(slot))
        except Exception as bug:  # not an I/O error
            self._on_error(f"persist failed: {bug}")
            return WriteOutcome.DROPPED
        if err is not None:  # e.g. a full disk: the tokens are served, the block not cached
            self.failures.failed(key, err)
            return WriteOutcome.DROPPED
        if self.tier is not None:  # written through: kept in DRAM too
            self.tier.put(key, self.buffer.slot(slot)[: self.block_bytes])
        with self._lock:
            self.bytes_written += self.block_bytes
        return WriteOutcome.STORED

    # ---------------------------------------------------------------- counters
    def counters(self) -> dict[str, Any]:
        """The node's I/O counters, by the names the side-car's ``stats`` reports."""
        with self._lock:
            out: dict[str, Any] = {
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "failed_writes": self.failures.num_failed,
                "skipped_writes": self.num_skipped_writes,
                "read_requests_waiting": self.read_waiting.requests,
                "read_bytes_waiting": self.read_waiting.bytes,
                "read_requests_in_flight": self.read_in_flight.requests,
                "read_bytes_in_flight": self.read_in_flight.bytes,
                "read_queued_s": self.read_queued_s,
                "read_store_s": self.read_store_s,
            }
        out["read_busy_s"] = self.snic[0].stats.busy_s if self.snic else 0.0
        out["write_busy_s"] = self.snic[1].stats.busy_s if self.snic else 0.0
        out["unfinished_writes"] = self.pending.num_pending  # queued or in hand
        out["pending_writes"] = self._writes.qsize()
        return out
