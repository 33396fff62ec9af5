"""What every runtime process receives at spawn: config, ids, buffers, queues, the clock.

``Clock`` is the one place a process reads time: seconds since the run's epoch on the
host-wide monotonic clock (one host here; on a cluster, a synchronised clock would go here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import dualpath.runtime.kvstore as kvs
from dualpath.config import Config
from dualpath.ledger import Topology
from dualpath.runtime.buffer import BufferSpec, SlotBuffer
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.transport.base import RegionHandle


@dataclass(frozen=True, slots=True)
class Clock:
    epoch: float

    def now(self) -> float:
        return time.monotonic() - self.epoch


HEARTBEAT_S = 0.2  # children's heartbeat period (liveness_timeout_s is many of these)
KV_DTYPE = "float32"  # the runtime model's KV dtype (model.kv_dtype_bytes must be 4)


@functools.lru_cache(maxsize=8)
def weights_digest(config: Config, weight_seed: int) -> str:
    """blake2b of every weight tensor of the runtime model (built from its seed, so a change
    of generator, init or shapes changes the digest too)."""
    from dualpath.runtime.model import TinyTransformer

    model = TinyTransformer(config.model, seed=weight_seed)
    h = hashlib.blake2b(digest_size=16)
    tensors = [model.embedding, model.final_norm, model.lm_head]
    for layer in model.layers:
        tensors.extend(getattr(layer, f) for f in layer.__dataclass_fields__)
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def kv_namespace(config: Config, weight_seed: int, tenant: str = "") -> str:
    """Hash-chain namespace: a fingerprint of everything a block's KV depends on — the model
    config, a digest of the weights, the KV dtype, the block size and the store's layout
    version — plus an optional per-tenant salt (blocks are never shared across tenants)."""
    from dualpath.runtime.kvstore import VERSION

    parts = {
        "model": asdict(config.model),
        "weights": weights_digest(config, weight_seed),
        "dtype": KV_DTYPE,
        "block_tokens": config.scheduler.block_tokens,
        "layout": VERSION,
        "tenant": tenant,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return f"{config.model.name}/{hashlib.blake2b(blob, digest_size=16).hexdigest()}"


@dataclass(frozen=True, slots=True)
class ProcEnv:
    """Shared, picklable context of one run (queues and locks travel only at spawn)."""

    config: Config
    options: RuntimeOptions
    topology: Topology
    buffers: tuple[BufferSpec, ...]  # one per node, index = node id
    locks: tuple[Any, ...]  # one multiprocessing lock per node buffer
    results: Any  # queue every process reports to (the scheduler's inbox)
    storage_inboxes: tuple[Any, ...]  # one per node
    epoch: float
    parent_pid: int
    regions: tuple[RegionHandle, ...] = ()  # per node, as announced by its storage worker
    heartbeats: Any = None  # shared doubles: last beat (clock seconds) per child, see below

    def heartbeat_slot(self, who: str) -> int:
        """Index of ``who``'s heartbeat: engines by id, then storage workers by node."""
        if who.startswith("storage@node"):
            return len(self.topology.engine_ids) + int(who.removeprefix("storage@node"))
        return next(e for e in self.topology.engine_ids if self.topology.engine_name(e) == who)

    def start_heartbeat(self, who: str) -> None:
        """Beat every ``HEARTBEAT_S`` from a daemon thread: a process that is stopped (SIGSTOP),
        or dead, stops beating; one busy computing keeps beating (torch releases the GIL)."""
        if self.heartbeats is None:
            return
        slot, beats, clock = self.heartbeat_slot(who), self.heartbeats, self.clock

        def beat() -> None:
            while True:
                beats[slot] = clock.now()
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    @property
    def clock(self) -> Clock:
        return Clock(self.epoch)

    @property
    def block_tokens(self) -> int:
        return self.config.scheduler.block_tokens

    @property
    def layout(self) -> kvs.BlockLayout:
        m = self.config.model
        return kvs.BlockLayout(m.num_layers, self.block_tokens, m.kv_bytes_per_token_per_layer)

    @property
    def namespace(self) -> str:
        return kv_namespace(self.config, self.options.weight_seed, self.options.tenant)

    def attach_buffer(self, node: int) -> SlotBuffer:
        return SlotBuffer.attach(self.buffers[node], self.locks[node])

    def region(self, node: int) -> RegionHandle:
        """Transport handle of node ``node``'s buffer (shared-memory backend: by name)."""
        if self.regions:
            return self.regions[node]
        spec = self.buffers[node]
        return RegionHandle("shm", spec.name, 0, spec.data_bytes)

    def store(self) -> kvs.KVStore:
        return kvs.KVStore(
            self.options.kv_root, self.layout, self.options.direct_io, self.namespace
        )

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid


def child_setup() -> None:
    """Common start of every child process: Ctrl-C is handled by the scheduler, one thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
