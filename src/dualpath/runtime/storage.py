"""A node's storage reader/writer process: KV store ↔ this node's buffer, through its SNIC.

Reads (``ReadMsg``) run FIFO on their own thread, two blocks in flight to keep the SNIC's
read direction busy; writes (``PersistMsg``) run on theirs over the SNIC's write direction
(design §13.5): the NIC is full duplex, so a block write never waits behind a read (the inbox
loop only dispatches; it used to run each read itself, and a DualPath decode node's writes,
which the agent's next turn waits for, queued behind its reads).
A missing or corrupt block ends the readable prefix; a corrupt file is removed so that the
recomputed block gets persisted again.

``dram-tier`` (docs/peers.md): the worker keeps a DRAM tier of Full Blocks (``kv.tier``) in
front of the store: a read found there is a copy over the node's DRAM, no SNIC; every block
read from storage or written to it, and every prompt block its node's PEs computed
(``TierPutMsg``), is kept, least recently used out first.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dualpath.kv.store as kvs
from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.pacer import Pacer, transfer_all
from dualpath.kv.store import KVStore
from dualpath.kv.tier import DramTier
from dualpath.kv.transport import make_transport
from dualpath.kv.worker import (
    FailingWrites,
    WriteFailures,
    persist_with_retry,
    read_or_miss,
    snic_pacers,
)
from dualpath.metrics.hops import hop
from dualpath.runtime.env import ProcEnv, child_setup
from dualpath.runtime.messages import (
    ErrorMsg,
    PersistedMsg,
    PersistMsg,
    ReadDoneMsg,
    ReadMsg,
    ReadyMsg,
    StopMsg,
    TierPutMsg,
)
from dualpath.types import TrafficClass

POLL_S = 0.5  # inbox poll: lets an orphaned worker notice its parent is gone


def write_faults(env: ProcEnv) -> FailingWrites | None:
    """The write hook ``env``'s fault plan asks for, if any."""
    count = env.options.faults.fail_writes
    return FailingWrites(count) if count else None


class StorageWorker:
    def __init__(self, env: ProcEnv, node: int, write_fn: kvs.WriteFn | None = None) -> None:
        self.env = env
        self.node = node
        self.name = f"storage@node{node}"
        self.buffer: SlotBuffer = env.attach_buffer(node)
        store = env.store()
        self.store: KVStore = store if write_fn is None else store.with_write_fn(write_fn)
        rate = env.config.hardware.snic_total_bytes_per_s
        now = env.clock.now  # the process's one clock
        # the SNIC carries LOW only (reads, persists): one FIFO, so the quantum changes no
        # grant and no completion time, only how often a waiter wakes (``SNIC_QUANTUM_S``)
        self.snic_read, self.snic_write = snic_pacers(rate, f"node{node}.snic", clock=now)
        # the node's DRAM (shared with its engines): a read lands in it, a persist leaves it
        link = env.dram_link(node)
        dram = (
            []
            if link is None
            else [Pacer(env.config.hardware.dram_bytes_per_s, f"dram{node}", clock=now, link=link)]
        )
        self.read_route = [self.snic_read, *dram]
        self.write_route = [self.snic_write, *dram]
        env.publish_nic_busy(f"snic_node{node}_read", [self.snic_read, self.snic_write])
        self.paced = env.options.paced_kv
        self.crash_on_read = False
        self.crash_on_write = False
        self.readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read")
        # reads and tier puts, in arrival order (a put lands before the read that needs it)
        self.reads: queue.Queue[ReadMsg | TierPutMsg | None] = queue.Queue()
        self.tier: DramTier | None = None
        if env.options.spec.reuse == "dram-tier":
            self.tier = DramTier(env.config.reuse.dram_tier_bytes)
        self.dram = dram
        self.writes: queue.Queue[PersistMsg | None] = queue.Queue()
        self.failures = WriteFailures(self.name)  # block writes dropped, and why
        # the node buffer as a transport region: the peer side of every engine's transfers
        self.transport = make_transport(env.options.transport)
        self.region = self.transport.register(self.buffer.spec.name, self.buffer.data)

    def _read_one(self, key: str, slot: int) -> tuple[bool, bool]:
        """(read and verified, found in the DRAM tier) of one block."""
        nbytes = self.store.layout.full_block_bytes
        out = self.buffer.slot(slot)
        if self.tier is not None and self.tier.get(key, out):  # DRAM → this node's buffer
            if self.paced and self.dram:
                transfer_all(self.dram, nbytes, TrafficClass.LOW)
            return True, True
        if self.paced:
            transfer_all(self.read_route, nbytes, TrafficClass.LOW)
        ok = read_or_miss(self.store, key, out)
        if ok and self.tier is not None:
            self.tier.put(key, out[:nbytes])
        return ok, False

    def _tier_put(self, msg: TierPutMsg) -> None:
        """Keep a durable block its node's PE computed: the bytes from the store (as the
        PE's D2H copy, this node's DRAM is charged, never its SNIC)."""
        assert self.tier is not None
        if msg.key in self.tier:
            return
        nbytes = self.store.layout.full_block_bytes
        block = bytearray(nbytes)
        if self.paced and self.dram:
            transfer_all(self.dram, nbytes, TrafficClass.LOW)
        if read_or_miss(self.store, msg.key, memoryview(block)):
            self.tier.put(msg.key, block)

    def handle_read(self, msg: ReadMsg) -> None:
        clock = self.env.clock
        start = clock.now()
        hop("storage.read", msg.request_id)
        done = list(self.readers.map(self._read_one, msg.keys, msg.slots))
        oks = [ok for ok, _ in done]
        num_ok = oks.index(False) if False in oks else len(oks)
        from_tier = sum(1 for _, tier in done[:num_ok] if tier)
        hop("storage.read_done", msg.request_id)
        self.env.results.put(
            ReadDoneMsg(msg.request_id, self.node, num_ok, start, clock.now(), from_tier)
        )

    def _read_loop(self) -> None:
        while (msg := self.reads.get()) is not None:
            try:
                if isinstance(msg, TierPutMsg):
                    self._tier_put(msg)
                    continue
                self.handle_read(msg)
            except Exception as bug:  # not an I/O error: fail the run, loudly
                self.env.results.put(ErrorMsg(self.name, f"read failed: {bug!r}"))
                return

    def _write_loop(self) -> None:
        while (msg := self.writes.get()) is not None:
            if self.paced:
                nbytes = self.store.layout.full_block_bytes
                transfer_all(self.write_route, nbytes, TrafficClass.LOW)
            # the slot is the scheduler's to free, on the ack: were this worker killed before
            # acking, it hands the write, slot intact, to the next one
            if self.failures.skip(msg.key):  # its path stayed in the way: not tried again
                self.env.results.put(PersistedMsg(msg.key, False, msg.node, msg.slot))
                continue
            try:
                err = persist_with_retry(self.store, msg.key, self.buffer.slot(msg.slot))
            except Exception as bug:  # not an I/O error: fail the run, loudly
                self.env.results.put(ErrorMsg(self.name, f"persist failed: {bug}"))
                continue
            if err is None and self.tier is not None:  # written through: kept in DRAM too
                self.tier.put(
                    msg.key, self.buffer.slot(msg.slot)[: self.store.layout.full_block_bytes]
                )
            if err is not None:  # e.g. a full disk: the tokens are served, the block not cached
                self.failures.failed(msg.key, err)
            self.env.results.put(PersistedMsg(msg.key, err is None, msg.node, msg.slot))

    def serve(self, inbox: Any) -> None:
        reader = threading.Thread(target=self._read_loop, name="reader", daemon=True)
        writer = threading.Thread(target=self._write_loop, name="writer", daemon=True)
        reader.start()
        writer.start()
        self.env.results.put(ReadyMsg(self.name, os.getpid(), self.region))
        try:
            while self.env.parent_alive():
                try:
                    msg = inbox.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if isinstance(msg, StopMsg):
                    break
                if isinstance(msg, ReadMsg):
                    if self.crash_on_read:
                        os._exit(19)  # fault injection: a storage worker dies mid-run
                    self.reads.put(msg)
                elif isinstance(msg, TierPutMsg) and self.tier is not None:
                    self.reads.put(msg)
                elif isinstance(msg, PersistMsg):
                    if self.crash_on_write:
                        os._exit(19)  # fault injection: dies holding a write it took
                    self.writes.put(msg)
        finally:
            while True:  # stopping: reads not started are dropped (nobody waits for them)
                try:
                    self.reads.get_nowait()
                except queue.Empty:
                    break
            self.reads.put(None)
            self.writes.put(None)
            reader.join()
            writer.join()
            self.readers.shutdown()
            self.transport.close()
            self.buffer.close()


def storage_main(
    env: ProcEnv, node: int, inbox: Any, crash_on_read: bool = False, crash_on_write: bool = False
) -> None:
    """Process entry point of node ``node``'s storage worker (``crash_on_*``: fault
    injection, ``FaultPlan``)."""
    child_setup(env.parent_pid, f"storage@node{node}")
    env.start_heartbeat(f"storage@node{node}")
    try:
        worker = StorageWorker(env, node, write_faults(env))
        worker.crash_on_read = crash_on_read
        worker.crash_on_write = crash_on_write
        worker.serve(inbox)
    except Exception as err:  # report, then exit non-zero: the scheduler shuts the run down
        env.results.put(ErrorMsg(f"storage@node{node}", f"{type(err).__name__}: {err}"))
        raise
