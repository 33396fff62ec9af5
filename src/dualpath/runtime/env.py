"""What every runtime process receives at spawn: config, ids, buffers, queues, the clock.

``Clock`` is the one place a process reads time: seconds since the run's epoch on the
host-wide monotonic clock (one host here; on a cluster, a synchronised clock would go here).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import dualpath.runtime.kvstore as kvs
from dualpath.config import Config
from dualpath.runtime.buffer import BufferSpec, SlotBuffer
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.topology import Topology
from dualpath.runtime.transport.base import RegionHandle


@dataclass(frozen=True, slots=True)
class Clock:
    epoch: float

    def now(self) -> float:
        return time.monotonic() - self.epoch


def kv_namespace(config: Config, weight_seed: int) -> str:
    """Hash-chain namespace: KV is only reusable by the same model, weights and block size."""
    return f"{config.model.name}/w{weight_seed}/b{config.scheduler.block_tokens}"


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
        return kv_namespace(self.config, self.options.weight_seed)

    def attach_buffer(self, node: int) -> SlotBuffer:
        return SlotBuffer.attach(self.buffers[node], self.locks[node])

    def region(self, node: int) -> RegionHandle:
        """Transport handle of node ``node``'s buffer (shared-memory backend: by name)."""
        if self.regions:
            return self.regions[node]
        spec = self.buffers[node]
        return RegionHandle("shm", spec.name, 0, spec.data_bytes)

    def store(self) -> kvs.KVStore:
        return kvs.KVStore(self.options.kv_root, self.layout, self.options.direct_io)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid


def child_setup() -> None:
    """Common start of every child process: Ctrl-C is handled by the scheduler, one thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
