"""A node's side-car for vLLM instances: its buffer, its storage NIC, the store's reads and writes.

One process per node (``python -m dualpath.integrations.vllm.sidecar SPEC_JSON``). It creates the
node's buffer (PE buffer or DE buffer, design §2: shared memory cut into Full-Block slots, locked
by an ``flock`` file so that any process of the node — the router, the vLLM workers — attaches
by name and allocates), and serves a few operations as JSON lines on a Unix socket:

- ``read``: Full Blocks from the store into given slots, through the SNIC's read direction
  (FIFO: two blocks in flight, or with a store across the network
  ``kv.storage_node.READ_JOBS_IN_FLIGHT`` requests in batched calls); the answer says how many
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
  slots), answered once every byte landed: the DE read path's hit KV (DE buffer → PE node),
  the PE read path's (PE node → DE buffer);
- ``push_layer`` / ``handed``: the prefill's KV, PE node → DE buffer, layer by layer while the
  prefill computes, and the router's wait for it (``cnic.ComputeNic``).

The reads, the writes, ``settle`` and the I/O counters are the storage-node core's
(``kv.storage_node.StorageNode``: its reader and writer threads and queues, the one
write-failure policy), shared with the runtime's storage worker; the side-car owns the buffer,
the slots, the persist jobs and the compute network, and frees a slot once its block is
durable. The SNIC is emulated by ``kv.pacer.Pacer`` (both directions LOW: KV traffic), unpaced
(``snic_bytes_per_s`` 0), or, in a cluster made by ``dualpath cluster up``, shaped by the
kernel on the node's ``snic`` interface. Owns no policy: what to read where is the router's.
The TCP port is unauthenticated, like Mooncake's own: bind it to a private network only.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.cnic import ComputeNic
from dualpath.integrations.vllm.node import LISTEN_BACKLOG, NodeSpec
from dualpath.integrations.vllm.token import REFUSAL, TOKEN_FIELD, admits, sidecar_token
from dualpath.kv import doorbell
from dualpath.kv.buffer import ANONYMOUS, SlotBuffer
from dualpath.kv.pacer import LinkLock
from dualpath.kv.storage_node import StorageNode, WriteOutcome
from dualpath.kv.store import BlockStore
from dualpath.kv.stores import open_store
from dualpath.kv.worker import snic_pacers

# a store call across the network: a batch of 64 blocks on a slow SNIC takes seconds (the
# router's request timeout bounds the request; this bounds a call stuck on a dead store)
STORE_CALL_TIMEOUT_S = 120.0
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


class NodeSidecar:
    """The node's buffer (owner), its slots and persist jobs; its store's I/O (``io``)."""

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
        self.io = StorageNode(
            f"node{spec.node}",
            self.store,
            self.buffer,
            snic=snic_pacers(rate, f"node{spec.node}.snic") if rate else None,
            open_client=self._open_store,
            skip_stored=True,
            on_written=self._on_written,
        )
        self._lock = threading.Lock()  # the jobs and the side-car's own counters
        self.cnic: ComputeNic | None = None  # a networked node's (``start_engine``)
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

    # ---------------------------------------------------------------- compute network
    def start_engine(self) -> None:
        """A networked node's transfer engine on its CNIC address, its buffer registered."""
        from dualpath.kv.transport.mooncake import MooncakeTransport

        engine = MooncakeTransport(hostname=self.spec.host)
        self.cnic = ComputeNic(engine, self.buffer, self.spec.layout, self.spec.buffer_name)

    def _cnic(self, op: str) -> ComputeNic:
        if self.cnic is None:
            raise ValueError(f"{op}: this node has no transfer engine (not networked)")
        return self.cnic

    # ---------------------------------------------------------------- reads, writes
    def read(self, keys: list[str], slots: list[int]) -> int:
        """Queue a read of ``keys`` into ``slots``; blocks until done; leading blocks read."""
        return self.io.read(keys, slots).result().num_ok

    def _on_written(self, key: str, slot: int, outcome: WriteOutcome) -> None:
        self.buffer.free([slot])  # durable, present already, or dropped: the slot is done

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
        self.io.write(pairs)
        return len(pairs)

    def part(self, op: dict[str, Any]) -> bool:
        """One worker's part of persist job ``op["job"]`` (of ``op["parts"]``); whether the
        job is now complete (and carried out). Its keys count as queued from the first part
        on, so that ``settle`` waits for them."""
        keys, slots = [str(k) for k in op["keys"]], [int(s) for s in op["slots"]]
        if len(keys) != len(slots):
            raise ValueError(f"parts: {len(keys)} keys for {len(slots)} slots")
        now = time.monotonic()
        with self._lock:
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
                self.io.pending.add(keys)
            job.seen.add(str(op["part"]))
            job.failed |= bool(op.get("failed"))
            if len(job.seen) < job.parts:
                return False
            del self._jobs[str(op["job"])]
            self.io.pending.drop(job.keys)
        if job.failed:  # a worker could not load what the slots hold: not to be trusted
            self.buffer.release([*job.slots, *job.free], job.owner)
            return True
        if job.free:
            self.buffer.release(job.free, job.owner)
        # the slots become the side-car's, all or none: slots the instance no longer holds
        # (it died and they were freed by its tag) may be someone else's by now
        if self.buffer.transfer(job.slots, job.owner, ANONYMOUS):
            self.io.write(list(zip(job.keys, job.slots, strict=True)))
        return True

    def _drop_stale(self, now: float) -> None:
        """(Under the lock) jobs whose parts stopped arriving: their instance died."""
        for name in [n for n, j in self._jobs.items() if now - j.since > JOB_TIMEOUT_S]:
            self.io.pending.drop(self._jobs.pop(name).keys)

    def settle(self, keys: list[str], timeout_s: float) -> dict[str, Any]:
        """Wait until none of ``keys`` is queued for a write (at most ``timeout_s``): how
        many still are, and whether any was (then the store may hold more than before)."""
        settled = self.io.pending.settle(keys, timeout_s)
        return {"waited": settled.waited, "pending": settled.pending}

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
        out: dict[str, Any] = {"node": self.spec.node, "kind": self.spec.kind}
        out.update(self.io.counters())
        with self._lock:
            out["waiting_jobs"] = len(self._jobs)  # persist jobs with parts still to come
            out["refused_requests"] = self.num_refused
        out.update(self.cnic.stats() if self.cnic is not None else {"bytes_pushed": 0})
        out["free_slots"] = self.buffer.num_free
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
            return self._cnic("region").describe()
        if kind == "push":
            moved = self._cnic("push").push(list(op["slots"]), str(op["to"]), list(op["to_slots"]))
            return {"bytes": moved}
        if kind == "push_layer":
            cnic = self._cnic("push_layer")
            jobs = [dict(j) for j in op["jobs"]]
            return {
                "submitted": cnic.push_layer(
                    int(op["layer"]), str(op["part"]), int(op["parts"]), jobs
                )
            }
        if kind == "handed":
            return {"missing": self._cnic("handed").handed(str(op["job"]), list(op["slots"]))}
        return {
            "error": f"op={kind!r} is invalid: must be read, write, parts, settle, stats, ping, "
            "describe, alloc, release, release_owner, region, push, push_layer or handed"
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
        self.io.start()
        listener = None
        if self.spec.networked:  # its router waits for free slots here (``alloc``)
            listener = threading.Thread(target=self._listen, name="doorbell", daemon=True)
            listener.start()

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
            if listener is not None:
                listener.join(timeout=5)
            # reads queued are still answered; writes queued before the stop still land
            self.io.stop(drop_reads=False, timeout_s=30)
            self.store.close()
            if self.cnic is not None:
                self.cnic.close()
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
