"""A node's side-car for vLLM instances: its buffer, its storage NIC, the store's reads and writes.

One process per node (``python -m dualpath.integrations.vllm.sidecar SPEC_JSON``). It creates the
node's buffer (PE buffer or DE buffer, design §2: shared memory cut into Full-Block slots, locked
by an ``flock`` file so that any process of the node — the router, the vLLM workers — attaches
by name and allocates), and serves a few operations as JSON lines on a Unix socket:

- ``read``: Full Blocks from the store into given slots, through the SNIC's read direction
  (FIFO: two blocks in flight, as the runtime's storage worker, or with a store across the
  network ``READ_JOBS_IN_FLIGHT`` requests in batched calls); the answer says how many
  leading blocks arrived (a missing or corrupt block ends the readable prefix; a corrupt file is
  removed so that the recomputed block gets persisted again);
- ``write``: slots written to the store through the SNIC's write direction, in order, each
  slot freed once its block is durable (``KVStore.write_block``: temp file, fsync, rename);
  with ``owner`` (a router's lease: a prefill node persisting the prompt it just computed,
  ``policy.side.SideRule.write_node``) only if every slot is still that lease's;
- ``parts``: the workers of an instance (tensor- and pipeline-parallel ranks) each report
  their part of a persist job (``plan.SlotPersist`` / ``PagedPersist``): the slots they
  loaded from, or the slots they copied their heads and layers into. Once every part of a
  job is in, the side-car frees the job's unused slots and queues its blocks for a write (or,
  when a worker's load failed, frees them all); a job whose parts never all arrive (its
  instance died meanwhile) is dropped after ``JOB_TIMEOUT_S`` (its slots go with its owner);
- ``settle``: waits (bounded) until none of given keys is queued for a write any more (written,
  skipped or failed): the router asks it before it looks up a new turn's hits, so that a turn
  sent right after the one that wrote its prefix hits that prefix (the store advertises only
  durable blocks, and the writes run behind the answer);
- ``stats``: bytes read, written and pushed, SNIC busy seconds.

A node of a cluster (``NodeSpec.host``: its own machine, or a network namespace of one host)
answers on TCP at its CNIC address instead, and serves what processes of other nodes cannot do
through shared memory:

- ``alloc`` / ``release``: slots of its buffer under an owner tag (the router's leases);
- ``region``: its buffer as registered with its transfer engine (endpoint, address, size);
- ``push``: given slots written into another node's buffer slots over the compute network
  (Mooncake Transfer Engine: TCP here, RDMA on clusters; one write per run of consecutive
  slots), answered once every byte landed: the DE read path's hit KV (DE buffer → PE node)
  and the prefill's KV (PE node → DE buffer).

The SNIC is emulated by ``kv.pacer.Pacer`` (both directions LOW: KV traffic), unpaced
(``snic_bytes_per_s`` 0), or, in a cluster made by ``dualpath cluster up``, shaped by the
kernel on the node's ``snic`` interface. Owns no policy: what to read where is the router's.
The TCP port is unauthenticated, like Mooncake's own: bind it to a private network only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import socketserver
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.node import LISTEN_BACKLOG, NodeSpec, call
from dualpath.integrations.vllm.token import REFUSAL, TOKEN_FIELD, admits, sidecar_token
from dualpath.kv import doorbell
from dualpath.kv.buffer import ANONYMOUS, SlotBuffer
from dualpath.kv.pacer import LinkLock, Pacer
from dualpath.kv.store import BlockCorrupt, BlockStore
from dualpath.kv.stores import open_store
from dualpath.kv.transport.base import RegionHandle
from dualpath.kv.worker import WriteFailures, persist_with_retry, read_or_miss, snic_pacers
from dualpath.types import TrafficClass

# requests a batched store reads at once: while one waits for the store's RPCs (a replica
# list, ~ms) the others keep the SNIC busy (measured on the one-host cluster, 16 agents ×
# 10 turns at 2 MB/s: DualPath's JCT 97.0 s with 2, 93.7 s with 3, its storage bound 78 s)
READ_JOBS_IN_FLIGHT = 3
# a store call across the network: a batch of 64 blocks on a slow SNIC takes seconds (the
# router's request timeout bounds the request; this bounds a call stuck on a dead store)
STORE_CALL_TIMEOUT_S = 120.0
WRITE_BATCH = 32  # blocks queued for the store written in one batched put, at most
# a persist job whose parts have not all arrived within this is dropped: a worker of its
# instance died (its slots are freed with the instance's owner tag)
JOB_TIMEOUT_S = 60.0
MAX_ALLOC_WAIT_S = 30.0  # an ``alloc`` waits for free slots at most this long per call


@dataclass(slots=True)
class _Job:
    """A persist job while its parts arrive (``NodeSidecar.part``)."""

    parts: int
    keys: list[str]
    slots: list[int]
    free: list[int]
    owner: int
    since: float
    seen: set[str] = field(default_factory=set)
    failed: bool = False


@dataclass(slots=True)
class _Queued:
    """Requests and their bytes in one stage of the SNIC's read queue (under the side-car's
    lock)."""

    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes

    def take(self, nbytes: int) -> None:
        self.requests -= 1
        self.bytes -= nbytes


class NodeSidecar:
    """The node's buffer (owner), store, SNIC pacers and the read / write queues."""

    def __init__(
        self, spec: NodeSpec, facts: dict[str, Any] | None = None, token: str | None = None
    ) -> None:
        """``facts``: what processes of other nodes learn of the deployment from it
        (``describe``: the weights' digest, the KV shape, the engine; ``standalone.py``).
        ``token``: the secret every request must carry (None: this process's,
        ``token.sidecar_token``; "": none asked for)."""
        self.spec = spec
        self.facts = dict(facts or {})
        self._token = sidecar_token() if token is None else token
        self.num_refused = 0  # requests refused for their token
        Path(spec.lock_path).touch(mode=0o600)
        self.buffer = SlotBuffer.create(spec.buffer, LinkLock(spec.lock_path))
        doorbell.make(spec.doorbell_path)  # rung by every process that frees slots
        self._bell = doorbell.Doorbell(spec.doorbell_path)
        self.buffer.on_free = self._bell.ring
        # a networked node's router waits for free slots here (``alloc`` with ``wait_s``):
        # woken by the doorbell (``_listen``), which its router cannot hear across nodes
        self._freed = threading.Condition()
        self._stopping = False
        # the files at kv_root, or a store across the network (Mooncake Store: its client binds
        # the node's SNIC address, so that the blocks cross that interface)
        self.store = self._open_store()
        rate = spec.snic_bytes_per_s
        name = f"node{spec.node}.snic"
        pacers = snic_pacers(rate, name) if rate else (None, None)
        self.snic_read: Pacer | None = pacers[0]
        self.snic_write: Pacer | None = pacers[1]
        # a store across the network gets a client per reader and one for the writes: one
        # client carries out its transfers one batch after the other, so a turn's few blocks
        # to persist would wait behind seconds of another request's reads (measured: a put of
        # 3 blocks 2.2 s instead of 0.3 s beside a 32-block read on a 2 MB/s SNIC)
        separate = self._batched()
        self.read_stores = [self.store] + [
            self._open_store() if separate else self.store for _ in range(READ_JOBS_IN_FLIGHT - 1)
        ]
        self.write_store = self._open_store() if separate else self.store
        self.readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read")
        self.reads: queue.Queue[tuple[list[str], list[int], Future[int], float] | None] = (
            queue.Queue()
        )
        self.writes: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.bytes_read = 0
        # the SNIC's read queue (the signal the paper's scheduler decides on, §4): requests and
        # bytes queued for a reader, and those a reader is moving now
        self.read_waiting = _Queued()
        self.read_in_flight = _Queued()
        # seconds reads spent queued for a reader and in the store's calls, summed
        self.read_queued_s = 0.0
        self.read_store_s = 0.0
        self.bytes_written = 0
        self.failures = WriteFailures(f"node{self.spec.node}")  # block writes dropped, and why
        self.num_skipped_writes = 0  # blocks another turn had persisted already
        self._lock = threading.Lock()
        self._queued: Counter[str] = Counter()  # keys handed to ``persist``, not done yet
        self._write_done = threading.Condition(self._lock)
        self.bytes_pushed = 0
        self.push_busy_s = 0.0
        self._engine: Any = None  # the transfer engine of a networked node (``start_engine``)
        self._region: RegionHandle | None = None
        self._peers: dict[str, RegionHandle] = {}  # control address → its registered buffer
        self._jobs: dict[str, _Job] = {}  # persist jobs some of whose parts arrived

    def _open_store(self) -> BlockStore:
        """A client of the node's store; across the network its transfer engine binds the
        SNIC's address (the blocks cross that interface) and reads land in the slots."""
        spec = self.spec
        store = open_store(
            spec.store,
            spec.layout,
            spec.store_namespace,
            local_hostname=spec.snic_host or "127.0.0.1",
            timeout_s=STORE_CALL_TIMEOUT_S,
        )
        store.register(self.buffer.data)  # (a store across the network: zero-copy)
        return store

    def _stores(self) -> list[BlockStore]:
        return list({id(s): s for s in [*self.read_stores, self.write_store]}.values())

    # ---------------------------------------------------------------- compute network
    def start_engine(self) -> None:
        """A networked node's transfer engine on its CNIC address, its buffer registered."""
        from dualpath.kv.transport.mooncake import MooncakeTransport

        self._engine = MooncakeTransport(hostname=self.spec.host)
        self._region = self._engine.register(self.spec.buffer_name, self.buffer.data)

    def region(self) -> dict[str, Any]:
        if self._region is None:
            raise ValueError("region: this node has no transfer engine (not networked)")
        r = self._region
        return {
            "endpoint": r.endpoint,
            "name": r.name,
            "address": r.address,
            "size_bytes": r.size_bytes,
        }

    def _peer(self, address: str, fresh: bool = False) -> RegionHandle:
        if fresh or address not in self._peers:
            self._peers[address] = RegionHandle(**call(address, {"op": "region"}, 10.0))
        return self._peers[address]

    def push(self, slots: list[int], to: str, to_slots: list[int]) -> int:
        """Write ``slots`` into the slots ``to_slots`` of the node whose side-car is at ``to``
        (its buffer as its transfer engine registered it); bytes moved."""
        if self._engine is None or self._region is None:
            raise ValueError("push: this node has no transfer engine (not networked)")
        if len(slots) != len(to_slots):
            raise ValueError(f"push: {len(slots)} slots for {len(to_slots)} peer slots")
        stride, nbytes = self.buffer.spec.stride_bytes, self.spec.layout.full_block_bytes
        runs = _runs(slots, to_slots)
        start = time.perf_counter()
        for attempt in (0, 1):  # a peer restarted since: its buffer registered anew
            peer = self._peer(to, fresh=attempt > 0)
            try:
                moves = [
                    self._engine.write(
                        self._region, s * stride, peer, d * stride, (k - 1) * stride + nbytes
                    )
                    for s, d, k in runs
                ]
                for move in moves:
                    move.wait()
                break
            except (RuntimeError, ValueError):
                if attempt:
                    raise
        moved = len(slots) * nbytes
        with self._lock:
            self.bytes_pushed += moved
            self.push_busy_s += time.perf_counter() - start
        return moved

    # ---------------------------------------------------------------- reads
    def _read_one(self, key: str, slot: int) -> bool:
        if self.snic_read is not None:
            self.snic_read.transfer(self.spec.layout.full_block_bytes, TrafficClass.LOW)
        return read_or_miss(self.store, key, self.buffer.slot(slot))

    def _read_loop(self, index: int = 0) -> None:
        store = self.read_stores[index]
        block = self.spec.layout.full_block_bytes
        while (job := self.reads.get()) is not None:
            keys, slots, done, since = job
            start = time.perf_counter()
            with self._lock:  # waiting → in flight
                self.read_waiting.take(len(keys) * block)
                self.read_in_flight.add(len(keys) * block)
                self.read_queued_s += start - since
            try:
                oks = self._read_job(store, keys, slots)
            except Exception as err:  # not a missing block: a bug or the disk; the reader lives on
                with self._lock:
                    self.read_in_flight.take(len(keys) * block)
                done.set_exception(err)
                continue
            num_ok = oks.index(False) if False in oks else len(oks)
            with self._lock:
                self.bytes_read += num_ok * block
                self.read_in_flight.take(len(keys) * block)
                self.read_store_s += time.perf_counter() - start
            done.set_result(num_ok)

    def _batched(self) -> bool:
        """Whether the store takes a request's blocks in one call (a store across the
        network: its round trips once per batch, the link kept busy) and no software SNIC
        paces them one by one."""
        return self.store.batched and self.snic_read is None

    def _read_job(self, store: BlockStore, keys: list[str], slots: list[int]) -> list[bool]:
        if not self._batched():
            return list(self.readers.map(self._read_one, keys, slots))
        errs = store.read_blocks(keys, [self.buffer.slot(s) for s in slots])
        for key, err in zip(keys, errs, strict=True):
            if isinstance(err, BlockCorrupt):  # recomputed, then stored again
                with contextlib.suppress(OSError):
                    store.remove(key)
        return [err is None for err in errs]

    def read(self, keys: list[str], slots: list[int]) -> int:
        """Queue a read of ``keys`` into ``slots``; blocks until done; leading blocks read."""
        if len(keys) != len(slots):
            raise ValueError(f"read: {len(keys)} keys for {len(slots)} slots")
        done: Future[int] = Future()
        with self._lock:
            self.read_waiting.add(len(keys) * self.spec.layout.full_block_bytes)
        self.reads.put((keys, slots, done, time.perf_counter()))
        return done.result()

    # ---------------------------------------------------------------- writes
    def _write_loop(self) -> None:
        while (job := self.writes.get()) is not None:
            batch = [job]
            while len(batch) < WRITE_BATCH and self._batched():  # what queued meanwhile
                try:
                    more = self.writes.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # the stop: after this batch
                    self.writes.put(None)
                    break
                batch.append(more)
            try:
                if self._batched():  # one existence query and one put, even for one block
                    self._write_batch(batch)
                else:
                    self._write_one(*job)
            finally:
                with self._write_done:
                    for key, _ in batch:
                        self._queued[key] -= 1
                        if self._queued[key] <= 0:
                            del self._queued[key]
                    self._write_done.notify_all()

    def _write_batch(self, batch: list[tuple[str, int]]) -> None:
        """Several blocks in one batched put (``MooncakeBlockStore.write_blocks``); one that
        failed is tried again alone, with ``persist_with_retry``'s backoff."""
        keys, slots = [k for k, _ in batch], [s for _, s in batch]
        results = self.write_store.write_blocks(keys, [self.buffer.slot(s) for s in slots])
        for (key, slot), res in zip(batch, results, strict=True):
            if isinstance(res, OSError):
                self._write_one(key, slot)
                continue
            self.buffer.free([slot])
            with self._lock:
                if res:
                    self.bytes_written += self.spec.layout.full_block_bytes
                else:
                    self.num_skipped_writes += 1

    def _write_one(self, key: str, slot: int) -> None:
        nbytes = self.spec.layout.full_block_bytes
        if self.failures.skip(key):  # its path stayed in the way: not tried again
            self.buffer.free([slot])
            return
        if self.write_store.has(key):  # content-addressed: a block stored is not resent
            self.buffer.free([slot])
            with self._lock:
                self.num_skipped_writes += 1
            return
        if self.snic_write is not None:
            self.snic_write.transfer(nbytes, TrafficClass.LOW)
        try:
            err = persist_with_retry(self.write_store, key, self.buffer.slot(slot))
        finally:
            self.buffer.free([slot])
        if err is None:
            with self._lock:
                self.bytes_written += nbytes
        else:  # e.g. a full disk: the tokens were served, the block is not cached
            self.failures.failed(key, err)  # counted (``failed_writes`` in /metrics), named

    def persist(self, keys: list[str], slots: list[int], owner: int | None = None) -> int:
        """Queue ``slots`` for a write as blocks ``keys``; how many were queued. ``owner``
        (the router's lease): the slots must all still be its, else nothing is queued (a
        request given up on meanwhile may have had them freed and taken by another)."""
        if len(keys) != len(slots):
            raise ValueError(f"persist: {len(keys)} keys for {len(slots)} slots")
        # the slots are the side-car's from now on: an instance that dies after handing them
        # over does not take them along (its slots are freed by owner tag)
        if owner is not None:
            if not self.buffer.transfer(slots, owner, ANONYMOUS):
                return 0
            held = set(slots)
        else:
            held = set(self.buffer.adopt(slots, ANONYMOUS))
        pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if s in held]
        self._queue_writes(pairs)
        return len(pairs)

    def _queue_writes(self, pairs: list[tuple[str, int]]) -> None:
        with self._lock:
            self._queued.update(k for k, _ in pairs)
        for pair in pairs:
            self.writes.put(pair)

    def part(self, op: dict[str, Any]) -> bool:
        """One worker's part of persist job ``op["job"]`` (of ``op["parts"]``); whether the
        job is now complete (and carried out). Its keys count as queued from the first part
        on, so that ``settle`` waits for them."""
        keys, slots = [str(k) for k in op["keys"]], [int(s) for s in op["slots"]]
        if len(keys) != len(slots):
            raise ValueError(f"parts: {len(keys)} keys for {len(slots)} slots")
        now = time.monotonic()
        with self._write_done:
            self._drop_stale(now)
            job = self._jobs.get(str(op["job"]))
            if job is None:
                job = self._jobs[str(op["job"])] = _Job(
                    int(op["parts"]),
                    keys,
                    slots,
                    [int(s) for s in op.get("free", [])],
                    int(op["owner"]),
                    now,
                )
                self._queued.update(keys)
            job.seen.add(str(op["part"]))
            job.failed |= bool(op.get("failed"))
            if len(job.seen) < job.parts:
                return False
            del self._jobs[str(op["job"])]
            self._unqueue(job.keys)
        if job.failed:  # a worker could not load what the slots hold: not to be trusted
            self.buffer.release([*job.slots, *job.free], job.owner)
            return True
        if job.free:
            self.buffer.release(job.free, job.owner)
        # the slots become the side-car's, all or none: slots the instance no longer holds
        # (it died and they were freed by its tag) may be someone else's by now
        if self.buffer.transfer(job.slots, job.owner, ANONYMOUS):
            self._queue_writes(list(zip(job.keys, job.slots, strict=True)))
        return True

    def _unqueue(self, keys: list[str]) -> None:
        """(Under the lock) ``keys`` no longer pending for this job."""
        for k in keys:
            self._queued[k] -= 1
            if self._queued[k] <= 0:
                del self._queued[k]
        self._write_done.notify_all()

    def _drop_stale(self, now: float) -> None:
        """(Under the lock) jobs whose parts stopped arriving: their instance died."""
        for name in [n for n, j in self._jobs.items() if now - j.since > JOB_TIMEOUT_S]:
            self._unqueue(self._jobs.pop(name).keys)

    def settle(self, keys: list[str], timeout_s: float) -> dict[str, Any]:
        """Wait until none of ``keys`` is queued for a write (at most ``timeout_s``): how
        many still are, and whether any was (then the store may hold more than before)."""
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"settle: timeout_s={timeout_s!r} is invalid: must be a number >= 0")
        with self._write_done:
            waited = any(k in self._queued for k in keys)
            if waited:
                self._write_done.wait_for(
                    lambda: not any(k in self._queued for k in keys), timeout=timeout_s
                )
            return {"waited": waited, "pending": sum(k in self._queued for k in keys)}

    def alloc(self, num_slots: int, owner: int, wait_s: float = 0.0) -> list[int] | None:
        """``num_slots`` slots under ``owner``; while the buffer is full, retried each time a
        process frees slots, for ``wait_s`` at most (then None)."""
        deadline = time.monotonic() + wait_s
        with self._freed:
            while (got := self.buffer.alloc(num_slots, owner=owner)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return None
                self._freed.wait(left)
        return got

    def _listen(self) -> None:
        """(A thread of a networked node's side-car.) Every ring of the doorbell wakes the
        ``alloc`` calls waiting for slots."""
        listener = doorbell.Listener(self.spec.doorbell_path, blocking=True)
        try:
            while not self._stopping:
                listener.wait()
                with self._freed:
                    self._freed.notify_all()
        finally:
            listener.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "node": self.spec.node,
                "kind": self.spec.kind,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "failed_writes": self.failures.num_failed,
                "skipped_writes": self.num_skipped_writes,
                "unfinished_writes": sum(self._queued.values()),  # queued or in hand
                "waiting_jobs": len(self._jobs),  # persist jobs with parts still to come
                "read_requests_waiting": self.read_waiting.requests,
                "read_bytes_waiting": self.read_waiting.bytes,
                "read_requests_in_flight": self.read_in_flight.requests,
                "read_bytes_in_flight": self.read_in_flight.bytes,
                "read_queued_s": self.read_queued_s,
                "read_store_s": self.read_store_s,
            }
            out["bytes_pushed"] = self.bytes_pushed
            out["push_busy_s"] = self.push_busy_s
        out["free_slots"] = self.buffer.num_free
        out["read_busy_s"] = self.snic_read.stats.busy_s if self.snic_read else 0.0
        out["write_busy_s"] = self.snic_write.stats.busy_s if self.snic_write else 0.0
        out["pending_writes"] = self.writes.qsize()
        out["refused_requests"] = self.num_refused
        return out

    def handle(self, op: dict[str, Any]) -> dict[str, Any]:
        kind = op.get("op")
        if kind == "read":
            return {"num_ok": self.read(list(op["keys"]), list(op["slots"]))}
        if kind == "write":
            owner = op.get("owner")
            return {
                "queued": self.persist(
                    list(op["keys"]), list(op["slots"]), None if owner is None else int(owner)
                )
            }
        if kind == "parts":
            return {"done": sum(self.part(dict(p)) for p in op["parts"])}
        if kind == "settle":
            return self.settle(list(op["keys"]), op["timeout_s"])
        if kind == "stats":
            return self.stats()
        if kind == "ping":
            return {"pid": os.getpid()}
        if kind == "describe":
            return {"spec": json.loads(self.spec.to_json()), "facts": self.facts}
        if kind == "alloc":
            wait_s = op.get("wait_s", 0.0)
            if not (isinstance(wait_s, int | float) and 0 <= wait_s <= MAX_ALLOC_WAIT_S):
                raise ValueError(
                    f"alloc: wait_s={wait_s!r} is invalid: must be a number in "
                    f"[0, {MAX_ALLOC_WAIT_S:g}]"
                )
            return {"slots": self.alloc(int(op["num_slots"]), int(op["owner"]), float(wait_s))}
        if kind == "release":
            return {"released": self.buffer.release(list(op["slots"]), int(op["owner"]))}
        if kind == "release_owner":
            return {"released": self.buffer.release_owner(int(op["owner"]))}
        if kind == "region":
            return self.region()
        if kind == "push":
            return {"bytes": self.push(list(op["slots"]), str(op["to"]), list(op["to_slots"]))}
        return {
            "error": f"op={kind!r} is invalid: must be read, write, parts, settle, stats, ping, "
            "describe, alloc, release, release_owner, region or push"
        }

    # ---------------------------------------------------------------- serving
    def serve_forever(self) -> None:
        sidecar = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        op = json.loads(line)
                    except ValueError as err:
                        op = err
                    # a request without the deployment's token (or no request at all, where
                    # one is asked for): one refusal, nothing done, the connection closed
                    given = op.pop(TOKEN_FIELD, None) if isinstance(op, dict) else None
                    refused = not admits(sidecar._token, given)
                    if refused:
                        answer = {"error": REFUSAL}
                        with sidecar._lock:
                            sidecar.num_refused += 1
                    elif isinstance(op, dict):
                        try:
                            answer = sidecar.handle(op)
                        except (KeyError, TypeError, ValueError, AttributeError) as err:
                            answer = {"error": f"{type(err).__name__}: {err}"}
                    else:
                        answer = {"error": f"a request is one JSON object per line: {op}"}
                    try:
                        self.wfile.write(json.dumps(answer).encode() + b"\n")
                        self.wfile.flush()
                    except OSError:  # the caller left (its timeout): nothing to answer
                        return
                    if refused:
                        return

        server: socketserver.BaseServer
        if self.spec.networked:
            self.start_engine()
            server = _TcpServer((self.spec.host, self.spec.control_port), Handler)
        else:
            Path(self.spec.socket_path).unlink(missing_ok=True)
            server = _UnixServer(self.spec.socket_path, Handler)
        # batched reads: two requests' reads in flight, so that the SNIC is busy while the
        # next request's batch starts (a store across the network: its round trips)
        readers = READ_JOBS_IN_FLIGHT if self._batched() else 1
        threads = [
            threading.Thread(target=self._read_loop, args=(i,), name=f"reader{i}", daemon=True)
            for i in range(readers)
        ]
        threads.append(threading.Thread(target=self._write_loop, name="writer", daemon=True))
        if self.spec.networked:
            threads.append(threading.Thread(target=self._listen, name="doorbell", daemon=True))
        for t in threads:
            t.start()

        def stop(signum: int, frame: Any) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()
            with self._freed:  # waiting allocs answer None; the doorbell's thread ends
                self._stopping = True
                self._freed.notify_all()
            self._bell.ring()
            for _ in range(readers):
                self.reads.put(None)
            self.writes.put(None)  # writes queued before the stop still land (durability)
            for t in threads:
                t.join(timeout=30)
            self.readers.shutdown()
            for store in self._stores():
                store.close()
            if self._engine is not None:
                self._engine.close()
            self.buffer.close()
            Path(self.spec.socket_path).unlink(missing_ok=True)
            Path(self.spec.lock_path).unlink(missing_ok=True)
            Path(self.spec.doorbell_path).unlink(missing_ok=True)


class _TcpServer(socketserver.ThreadingTCPServer):
    """A thread per connection (callers keep theirs open: ``node.SidecarPool``), a listening
    queue that takes a burst (``LISTEN_BACKLOG``)."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


def _runs(slots: list[int], to_slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first peer slot, count) of each run consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(slots, to_slots, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print(
            "usage: python -m dualpath.integrations.vllm.sidecar SPEC_JSON [FACTS_JSON]",
            file=sys.stderr,
        )
        return 2
    facts = json.loads(args[1]) if len(args) == 2 else {}
    NodeSidecar(NodeSpec.from_json(args[0]), facts).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
