"""A node's storage worker process: KV store ↔ this node's buffer, through its SNIC.

A thin shell around the storage-node core (``kv.storage_node.StorageNode``: reads FIFO on a
thread of their own, two blocks in flight; writes on theirs, so a block write never waits
behind a read): it turns its inbox's messages (``ReadMsg``, ``PersistMsg``, ``TierPutMsg``)
into the core's calls and their outcomes into result messages (``ReadDoneMsg``,
``PersistedMsg``, ``ErrorMsg``). The inbox loop only dispatches.

``dram-tier`` (docs/peers.md): the worker keeps a DRAM tier of Full Blocks (``kv.tier``) in
front of the store: a read found there is a copy over the node's DRAM, no SNIC; every block
read from storage or written to it, and every prompt block its node's PEs computed
(``TierPutMsg``), is kept, least recently used out first.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future
from functools import partial
from typing import Any

import dualpath.kv.store as kvs
from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.pacer import Pacer
from dualpath.kv.storage_node import ReadDone, StorageNode, WriteOutcome
from dualpath.kv.tier import DramTier
from dualpath.kv.transport import make_transport
from dualpath.kv.worker import FailingWrites, snic_pacers
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
        self.store = store if write_fn is None else store.with_write_fn(write_fn)
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
        env.publish_nic_busy(f"snic_node{node}_read", [self.snic_read, self.snic_write])
        paced = env.options.paced_kv
        self.tier: DramTier | None = None
        if env.options.spec.reuse == "dram-tier":
            self.tier = DramTier(env.config.reuse.dram_tier_bytes)
        self.io = StorageNode(
            self.name,
            self.store,
            self.buffer,
            snic=(self.snic_read, self.snic_write) if paced else None,
            dram=dram if paced else (),
            tier=self.tier,
            on_written=self._on_written,
            on_read_started=partial(hop, "storage.read"),
            on_error=self._on_error,
            clock=now,
        )
        self.failures = self.io.failures  # block writes dropped, and why
        self.crash_on_read = False
        self.crash_on_write = False
        # the node buffer as a transport region: the peer side of every engine's transfers
        self.transport = make_transport(env.options.transport)
        self.region = self.transport.register(self.buffer.spec.name, self.buffer.data)

    def _on_error(self, message: str) -> None:  # not an I/O error: fail the run, loudly
        self.env.results.put(ErrorMsg(self.name, message))

    def _on_written(self, key: str, slot: int, outcome: WriteOutcome) -> None:
        # the slot is the scheduler's to free, on the ack: were this worker killed before
        # acking, it hands the write, slot intact, to the next one
        ok = outcome is not WriteOutcome.DROPPED
        self.env.results.put(PersistedMsg(key, ok, self.node, slot))

    def handle_read(self, msg: ReadMsg) -> None:
        done = self.io.read(msg.keys, msg.slots, msg.request_id)
        done.add_done_callback(partial(self._read_done, msg.request_id))

    def _read_done(self, request_id: int, done: Future[ReadDone]) -> None:
        if done.cancelled():  # dropped at the stop: nobody waits for it
            return
        err = done.exception()
        if err is not None:
            self._on_error(f"read failed: {err!r}")
            return
        r = done.result()
        hop("storage.read_done", request_id)
        self.env.results.put(
            ReadDoneMsg(request_id, self.node, r.num_ok, r.started_s, r.done_s, r.num_from_tier)
        )

    def serve(self, inbox: Any) -> None:
        self.io.start()
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
                    self.handle_read(msg)
                elif isinstance(msg, TierPutMsg) and self.tier is not None:
                    self.io.keep(msg.key)
                elif isinstance(msg, PersistMsg):
                    if self.crash_on_write:
                        os._exit(19)  # fault injection: dies holding a write it took
                    self.io.write([(msg.key, msg.slot)])
        finally:
            self.io.stop(drop_reads=True)  # reads not started are dropped: nobody waits
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
