"""What every runtime process receives at spawn: config, ids, buffers, queues, the clock.

``Clock`` is the one place a process reads time: seconds since the run's epoch on the
host-wide monotonic clock, or across hosts (Ray) on the wall clock, which NTP/PTP keeps in step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import dualpath.kv.store as kvs
from dualpath.config import Config
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.transport.base import RegionHandle
from dualpath.ledger import Topology
from dualpath.runtime.liveness import start_time
from dualpath.runtime.options import RuntimeOptions


@dataclass(frozen=True, slots=True)
class Clock:
    epoch: float
    wall: bool = False  # time.time(): the one clock several hosts share (synchronised)

    def now(self) -> float:
        return (time.time() if self.wall else time.monotonic()) - self.epoch


HEARTBEAT_S = 0.2  # children's heartbeat period (liveness_timeout_s is many of these)


@functools.lru_cache(maxsize=8)
def weights_digest(config: Config, weight_seed: int, model_dir: str = "") -> str:
    """Fingerprint of the weights the engines run: blake2b of every weight tensor of the tiny
    model (built from its seed, so a change of generator, init or shapes changes it too), or of
    a checkpoint's files (``kv.weights.checkpoint_digest``)."""
    if model_dir:
        from dualpath.kv.weights import checkpoint_digest

        return checkpoint_digest(model_dir)
    from dualpath.runtime.tiny import TinyTransformer

    h = hashlib.blake2b(digest_size=16)
    for t in TinyTransformer(config.model, seed=weight_seed).tensors():
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def kv_namespace(
    config: Config, weights: str | int, tenant: str = "", dtype: str = "float32"
) -> str:
    """Hash-chain namespace: a fingerprint of everything a block's KV depends on — the model
    config, the weights (a digest, or the tiny model's seed), the KV dtype, the block size and
    the store's layout version — plus an optional per-tenant salt (blocks are never shared
    across tenants)."""
    from dualpath.kv.store import VERSION

    digest = weights if isinstance(weights, str) else weights_digest(config, weights)
    parts = {
        "model": asdict(config.model),
        "weights": digest,
        "dtype": dtype,
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
    # per node, an object with SlotBuffer's alloc / alloc_wait / free / num_free / spec / close
    # that allocates through the node's storage worker (Ray: nodes share no memory); () = attach
    slot_owners: tuple[Any, ...] = ()
    wall_clock: bool = False
    nic_busy: Any = None  # shared doubles: busy seconds of each NIC direction's pacer, below
    # shared pacer links (``pacer.SharedLink``): engine e's CNIC tx at 2e, rx at 2e + 1, then
    # node n's DRAM at 2·engines + n; empty: every process paces its own links only
    links: tuple[Any, ...] = ()
    # per PE (index = engine id): its hidden-state exchange segment ("" = none, group of one)
    exchange_names: tuple[str, ...] = ()
    # no shared segments (Ray: nodes share no memory): each PE of a group of two or more makes
    # its own exchange region and announces it in its readiness ack
    own_exchange: bool = False
    weights: str = ""  # the launcher's ``weights_digest`` (computed once per run, not per child)

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

    def nic_names(self) -> list[str]:
        """Names of the ``nic_busy`` slots: each engine's CNIC (tx, rx), then each node's SNIC
        (read, write)."""
        names = []
        for e in self.topology.engine_ids:
            names += [f"cnic_engine{e}_tx", f"cnic_engine{e}_rx"]
        for n in range(self.topology.num_nodes):
            names += [f"snic_node{n}_read", f"snic_node{n}_write"]
        return names

    def publish_nic_busy(self, first_name: str, pacers: list[Any]) -> None:
        """Copy ``pacers``' busy seconds into their ``nic_busy`` slots (from ``first_name`` on)
        every ``HEARTBEAT_S`` from a daemon thread, for a server's utilisation metrics."""
        if self.nic_busy is None:
            return
        first, slots = self.nic_names().index(first_name), self.nic_busy

        def publish() -> None:
            while True:
                for i, pacer in enumerate(pacers):
                    slots[first + i] = pacer.stats.busy_s
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=publish, name="nic-busy", daemon=True).start()

    @property
    def clock(self) -> Clock:
        return Clock(self.epoch, self.wall_clock)

    @property
    def block_tokens(self) -> int:
        return self.config.scheduler.block_tokens

    @property
    def layout(self) -> kvs.BlockLayout:
        m = self.config.model
        return kvs.BlockLayout(m.num_layers, self.block_tokens, m.kv_bytes_per_token_per_layer)

    def namespace_for(self, tenant: str) -> str:
        """The hash chain's namespace of ``tenant``'s blocks."""
        weights = self.weights or weights_digest(
            self.config, self.options.weight_seed, self.options.model_dir
        )
        return kv_namespace(self.config, weights, tenant, self.options.dtype)

    @property
    def namespace(self) -> str:
        """The default tenant's namespace (``RuntimeOptions.tenant``)."""
        return self.namespace_for(self.options.tenant)

    def build_model(self, engine_id: int) -> Any:
        """The model engine ``engine_id`` runs (a ``model.RuntimeModel``) on its device, with
        its share of the host's cores (``RuntimeOptions.engine_threads``)."""
        import torch

        opts = self.options
        torch.set_num_threads(
            opts.engine_threads(len(self.topology.engine_ids), os.cpu_count() or 1)
        )
        if not opts.model_dir:
            from dualpath.runtime.tiny import TinyTransformer

            return TinyTransformer(self.config.model, seed=opts.weight_seed)
        from dualpath.runtime.hf_model import DTYPES, HFTransformer

        count = torch.cuda.device_count() if opts.device.startswith("cuda") else 0
        device = opts.engine_device(engine_id, count)
        return HFTransformer.from_dir(opts.model_dir, device=device, dtype=DTYPES[opts.dtype])

    def cnic_links(self, engine: int) -> tuple[Any, Any] | None:
        """Shared (tx, rx) links of ``engine``'s CNIC, or None when links are per process."""
        if not self.links:
            return None
        return self.links[2 * engine], self.links[2 * engine + 1]

    def dram_link(self, node: int) -> Any:
        """Shared link of ``node``'s DRAM (half duplex), or None."""
        if not self.links:
            return None
        return self.links[2 * len(self.topology.engine_ids) + node]

    def group_members(self, engine: int) -> tuple[int, ...]:
        """The PEs of ``engine``'s group, in id order."""
        g = self.topology.group_of(engine)
        return tuple(e for e in self.topology.pe_ids if self.topology.group_of(e) == g)

    def attach_buffer(self, node: int) -> Any:
        """Node ``node``'s buffer (a ``SlotBuffer``, or its owner's remote allocator)."""
        if self.slot_owners:
            return self.slot_owners[node]
        return SlotBuffer.attach(self.buffers[node], self.locks[node])

    def region(self, node: int) -> RegionHandle:
        """Transport handle of node ``node``'s buffer (shared-memory backend: by name)."""
        if self.regions:
            return self.regions[node]
        spec = self.buffers[node]
        return RegionHandle("shm", spec.name, 0, spec.data_bytes)

    def store(self) -> kvs.KVStore:
        """The persistent store; its block headers carry the tenant-free namespace (the
        tenant salts the keys, ``namespace_for``)."""
        return kvs.KVStore(
            self.options.kv_root, self.layout, self.options.direct_io, self.namespace_for("")
        )

    def parent_alive(self) -> bool:
        """The launcher lives: it is this process's parent (spawn), or, for a child of the
        fork server (whose children keep it alive, so it cannot be what is watched), the
        launcher's process still exists with the start time it had (``child_setup``)."""
        if _launcher is None:
            return os.getppid() == self.parent_pid
        global _checked_s
        now = time.monotonic()
        if now - _checked_s < LAUNCHER_CHECK_S:
            return True
        _checked_s = now
        pid, started = _launcher
        return started is not None and start_time(pid) == started


LAUNCHER_CHECK_S = 0.2  # a fork-server child reads the launcher's /proc entry this often
_launcher: tuple[int, str | None] | None = None  # (pid, start time): set for fork-server children
_checked_s = float("-inf")


def child_setup(launcher_pid: int, name: str = "") -> None:
    """Common start of every child process: Ctrl-C is handled by the scheduler, one thread;
    a child whose parent is not the launcher ``launcher_pid`` came from the fork server:
    ``parent_alive`` then watches the launcher through /proc. ``name`` (e.g. storage@node0)
    becomes the process's name where the OS has one (``ps -o comm``, ``top``)."""
    global _launcher
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if name:
        set_process_name(name)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.getppid() != launcher_pid:
        _launcher = (launcher_pid, start_time(launcher_pid))


def set_process_name(name: str) -> None:
    """This process's name in /proc (Linux: 15 bytes at most); nothing elsewhere."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name[:15])
