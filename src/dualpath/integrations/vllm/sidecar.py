"""A node's side-car for vLLM instances: its buffer, its storage NIC, the store's reads and writes.

One process per node (``python -m dualpath.integrations.vllm.sidecar SPEC_JSON``). It creates the
node's buffer (PE buffer or DE buffer, SPEC §2: shared memory cut into Full-Block slots, locked
by an ``flock`` file so that any process of the node — the router, the vLLM workers — attaches
by name and allocates), and serves a few operations as JSON lines on a Unix socket:

- ``read``: Full Blocks from the store into given slots, through the SNIC's read direction
  (FIFO, two blocks in flight, as the runtime's storage worker); the answer says how many
  leading blocks arrived (a missing or corrupt block ends the readable prefix; a corrupt file is
  removed so that the recomputed block gets persisted again);
- ``write``: slots written to the store through the SNIC's write direction, in order, each
  slot freed once its block is durable (``KVStore.write_block``: temp file, fsync, rename);
- ``settle``: waits (bounded) until none of given keys is queued for a write any more (written,
  skipped or failed): the router asks it before it looks up a new turn's hits, so that a turn
  sent right after the one that wrote its prefix hits that prefix (the store advertises only
  durable blocks, and the writes run behind the answer);
- ``stats``: bytes read and written, SNIC busy seconds.

The SNIC is emulated by ``runtime.pacer.Pacer`` (both directions LOW: KV traffic), or unpaced
(``snic_bytes_per_s`` 0). Owns no policy: what to read where is the router's decision.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import socketserver
import sys
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.node import NodeSpec
from dualpath.runtime.buffer import ANONYMOUS, SlotBuffer
from dualpath.runtime.kvstore import KVStore
from dualpath.runtime.pacer import LinkLock, Pacer
from dualpath.runtime.storage import SNIC_QUANTUM_S, persist_with_retry, read_or_miss
from dualpath.types import TrafficClass


class NodeSidecar:
    """The node's buffer (owner), store, SNIC pacers and the read / write queues."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        Path(spec.lock_path).touch(mode=0o600)
        self.buffer = SlotBuffer.create(spec.buffer, LinkLock(spec.lock_path))
        self.store = KVStore(spec.kv_root, spec.layout, namespace=spec.store_namespace)
        rate = spec.snic_bytes_per_s
        name = f"node{spec.node}.snic"
        self.snic_read = Pacer(rate, f"{name}.read", quantum_s=SNIC_QUANTUM_S) if rate else None
        self.snic_write = Pacer(rate, f"{name}.write", quantum_s=SNIC_QUANTUM_S) if rate else None
        self.readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="read")
        self.reads: queue.Queue[tuple[list[str], list[int], Future[int]] | None] = queue.Queue()
        self.writes: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self.bytes_read = 0
        self.bytes_written = 0
        self.num_failed_writes = 0
        self.num_skipped_writes = 0  # blocks another turn had persisted already
        self._lock = threading.Lock()
        self._queued: Counter[str] = Counter()  # keys handed to ``persist``, not done yet
        self._write_done = threading.Condition(self._lock)

    # ---------------------------------------------------------------- reads
    def _read_one(self, key: str, slot: int) -> bool:
        if self.snic_read is not None:
            self.snic_read.transfer(self.spec.layout.full_block_bytes, TrafficClass.LOW)
        return read_or_miss(self.store, key, self.buffer.slot(slot))

    def _read_loop(self) -> None:
        while (job := self.reads.get()) is not None:
            keys, slots, done = job
            try:
                oks = list(self.readers.map(self._read_one, keys, slots))
            except Exception as err:  # not a missing block: a bug or the disk; the reader lives on
                done.set_exception(err)
                continue
            num_ok = oks.index(False) if False in oks else len(oks)
            with self._lock:
                self.bytes_read += num_ok * self.spec.layout.full_block_bytes
            done.set_result(num_ok)

    def read(self, keys: list[str], slots: list[int]) -> int:
        """Queue a read of ``keys`` into ``slots``; blocks until done; leading blocks read."""
        if len(keys) != len(slots):
            raise ValueError(f"read: {len(keys)} keys for {len(slots)} slots")
        done: Future[int] = Future()
        self.reads.put((keys, slots, done))
        return done.result()

    # ---------------------------------------------------------------- writes
    def _write_loop(self) -> None:
        while (job := self.writes.get()) is not None:
            key, slot = job
            try:
                self._write_one(key, slot)
            finally:
                with self._write_done:
                    self._queued[key] -= 1
                    if self._queued[key] <= 0:
                        del self._queued[key]
                    self._write_done.notify_all()

    def _write_one(self, key: str, slot: int) -> None:
        nbytes = self.spec.layout.full_block_bytes
        if self.store.has(key):  # content-addressed: a block already stored is not resent
            self.buffer.free([slot])
            with self._lock:
                self.num_skipped_writes += 1
            return
        if self.snic_write is not None:
            self.snic_write.transfer(nbytes, TrafficClass.LOW)
        try:
            err = persist_with_retry(self.store, key, self.buffer.slot(slot))
        finally:
            self.buffer.free([slot])
        with self._lock:
            if err is None:
                self.bytes_written += nbytes
            else:  # e.g. a full disk: the tokens were served, the block is not cached
                self.num_failed_writes += 1
        if err is not None and self.num_failed_writes == 1:
            print(f"dualpath: node{self.spec.node}: block not cached: {err}", file=sys.stderr)

    def persist(self, keys: list[str], slots: list[int]) -> int:
        if len(keys) != len(slots):
            raise ValueError(f"persist: {len(keys)} keys for {len(slots)} slots")
        # the slots are the side-car's from now on: an instance that dies after handing them
        # over does not take them along (its slots are freed by owner tag)
        held = set(self.buffer.adopt(slots, ANONYMOUS))
        pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if s in held]
        with self._lock:
            self._queued.update(k for k, _ in pairs)
        for pair in pairs:
            self.writes.put(pair)
        return len(pairs)

    def settle(self, keys: list[str], timeout_s: float) -> dict[str, Any]:
        """Wait until none of ``keys`` is queued for a write (at most ``timeout_s``): how
        many still are, and whether any was (then the store may hold more than before)."""
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"settle: timeout_s={timeout_s!r} is invalid: must be a number >= 0")
        with self._write_done:
            waited = any(k in self._queued for k in keys)
            if waited:
                self._write_done.wait_for(lambda: not any(k in self._queued for k in keys),
                                          timeout=timeout_s)  # fmt: skip
            return {"waited": waited, "pending": sum(k in self._queued for k in keys)}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "node": self.spec.node,
                "kind": self.spec.kind,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "failed_writes": self.num_failed_writes,
                "skipped_writes": self.num_skipped_writes,
                "unfinished_writes": sum(self._queued.values()),  # queued or in hand
            }
        out["free_slots"] = self.buffer.num_free
        out["read_busy_s"] = self.snic_read.stats.busy_s if self.snic_read else 0.0
        out["write_busy_s"] = self.snic_write.stats.busy_s if self.snic_write else 0.0
        out["pending_writes"] = self.writes.qsize()
        return out

    def handle(self, op: dict[str, Any]) -> dict[str, Any]:
        kind = op.get("op")
        if kind == "read":
            return {"num_ok": self.read(list(op["keys"]), list(op["slots"]))}
        if kind == "write":
            return {"queued": self.persist(list(op["keys"]), list(op["slots"]))}
        if kind == "settle":
            return self.settle(list(op["keys"]), op["timeout_s"])
        if kind == "stats":
            return self.stats()
        if kind == "ping":
            return {"pid": os.getpid()}
        return {"error": f"op={kind!r} is invalid: must be read, write, settle, stats or ping"}

    # ---------------------------------------------------------------- serving
    def serve_forever(self) -> None:
        sidecar = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        answer = sidecar.handle(json.loads(line))
                    except (KeyError, TypeError, ValueError) as err:
                        answer = {"error": f"{type(err).__name__}: {err}"}
                    self.wfile.write(json.dumps(answer).encode() + b"\n")
                    self.wfile.flush()

        Path(self.spec.socket_path).unlink(missing_ok=True)
        server = socketserver.ThreadingUnixStreamServer(self.spec.socket_path, Handler)
        server.daemon_threads = True
        threads = [threading.Thread(target=self._read_loop, name="reader", daemon=True),
                   threading.Thread(target=self._write_loop, name="writer", daemon=True)]  # fmt: skip
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
            self.reads.put(None)
            self.writes.put(None)  # writes queued before the stop still land (durability)
            for t in threads:
                t.join(timeout=30)
            self.readers.shutdown()
            self.buffer.close()
            Path(self.spec.socket_path).unlink(missing_ok=True)
            Path(self.spec.lock_path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dualpath.integrations.vllm.sidecar SPEC_JSON", file=sys.stderr)
        return 2
    NodeSidecar(NodeSpec.from_json(args[0])).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
