"""Spawns and supervises the runtime's processes; owns the node buffers' lifetime.

Per node: one buffer (PE or DE buffer, shared memory) and one storage worker; per emulated
GPU: one engine process. Readiness acks at start. Whether a child lives is read from /proc
(pid and start time, ``liveness``), never from ``multiprocessing``'s exit codes (a dead fork
server makes it report every child it started as exited). ``respawn`` / ``respawn_storage``
kill the old incarnation, confirm it gone, then start a new one on a fresh inbox (no two
generations ever read one inbox); ``check_fork_server`` restarts a dead fork server and
touches none of its children. ``close`` stops everything (StopMsg, wait, then SIGKILL what is
left, each confirmed gone) and unlinks the buffers, so no process or segment outlives the run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Set as AbstractSet
from dataclasses import replace
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

from dualpath.config import Config
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.pacer import LinkLock, Pacer, PacerStats, SharedLink
from dualpath.kv.store import BlockLayout
from dualpath.kv.transport.base import RegionHandle
from dualpath.ledger import Topology
from dualpath.runtime.engine_proc import engine_main
from dualpath.runtime.env import ProcEnv, weights_digest
from dualpath.runtime.exchange import region_bytes
from dualpath.runtime.liveness import ProcId, is_running, kill_confirmed, wait_gone
from dualpath.runtime.messages import ErrorMsg, ReadyMsg, RegionsMsg, StopMsg
from dualpath.runtime.options import RuntimeOptions, buffer_slots, startup_warning
from dualpath.runtime.queues import DeathSafeQueue, discard_queue
from dualpath.runtime.storage import storage_main

JOIN_TIMEOUT_S = 10.0
READY_POLL_S = 0.1  # how often start-up checks that children are still alive
SPAWN_TRIES = 2  # a start the fork server died under is tried once more, with a new one


class RuntimeFailure(Exception):
    """A runtime process failed; the message names it."""


def check_kv_root(kv_root: str) -> None:
    """RuntimeFailure (one line) unless the KV root can be created and written."""
    try:
        Path(kv_root).mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=kv_root, prefix=".probe-"):
            pass
    except OSError as err:
        raise RuntimeFailure(
            f"kv_root {kv_root!r} is not a writable directory ({err.strerror or err})"
        ) from None


# imported once by the fork server, before any child forks from it
PRELOAD = ("dualpath.runtime.pe_engine", "dualpath.runtime.de_engine", "dualpath.runtime.hf_model")


class Launcher:
    def __init__(self, config: Config, options: RuntimeOptions) -> None:
        self.config = config
        self.options = options
        self.topology = Topology.from_config(config)
        # children fork from one server process that imported the engines' modules (torch)
        # once, instead of each importing them anew: start-up is CPU-bound on a small host
        # (Linux: a child watches the launcher through /proc, ``env.child_setup``; elsewhere,
        # spawn)
        self.ctx: Any = mp.get_context("forkserver" if sys.platform == "linux" else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(list(PRELOAD))
        self.buffers: list[SlotBuffer] = []
        self.procs: dict[str, Any] = {}
        self.idents: dict[str, ProcId] = {}  # each child's pid and start time (liveness)
        self.engine_inbox: dict[int, Any] = {}
        self.storage_inbox: dict[int, Any] = {}  # per node, its current worker's (fresh each)
        self.storage_generation: dict[int, int] = {}  # per node, workers started so far
        self.fork_server: ProcId | None = None  # the one children fork from (Linux)
        self.results: Any = self.ctx.Queue()
        self.env: ProcEnv | None = None
        self.heartbeats: Any = None  # RawArray of doubles, one per child (see ProcEnv)
        self.nic_busy: Any = None  # RawArray: busy seconds per NIC direction (see ProcEnv)
        self.link_dir: str | None = None
        self.exchanges: list[SharedMemory] = []  # PEs' hidden-state exchange segments
        self.engine_regions: dict[str, RegionHandle] = {}  # engine name → exchange region
        self._early_ready: set[str] = set()  # engines acked while the storage workers started

    def start(self) -> ProcEnv:
        topo, cfg = self.topology, self.config
        check_kv_root(self.options.kv_root)  # before any process or buffer exists
        warning = startup_warning(self.options)
        if warning:
            print(warning, file=sys.stderr)  # one line, once per run
        layout = BlockLayout(
            cfg.model.num_layers, cfg.scheduler.block_tokens, cfg.model.kv_bytes_per_token_per_layer
        )
        tag = f"dp{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # lock files: the links', the node buffers' and the shared queues' writer locks (flock:
        # the kernel releases a lock whose holder is killed, where a semaphore stays taken)
        self.link_dir = tempfile.mkdtemp(prefix=f"{tag}-links-")
        specs, locks = [], []
        for node in range(topo.num_nodes):
            slots = buffer_slots(cfg, self.options, topo.kind_of_node(node).value == "pe")
            spec = BufferSpec(f"{tag}-n{node}", slots, layout.full_block_bytes)
            lock = self._file_lock(f"buffer{node}")
            self.buffers.append(SlotBuffer.create(spec, lock))
            specs.append(spec)
            locks.append(lock)
        self.results = self._queue("results")
        self.heartbeats = self.ctx.RawArray("d", len(topo.engine_ids) + topo.num_nodes)
        self.nic_busy = self.ctx.RawArray("d", 2 * (len(topo.engine_ids) + topo.num_nodes))
        links = tuple(
            SharedLink.create(self.ctx, os.path.join(self.link_dir, f"link{i}.lock"))
            for i in range(2 * len(topo.engine_ids) + topo.num_nodes)
        )
        env = ProcEnv(
            cfg,
            self.options,
            topo,
            tuple(specs),
            tuple(locks),
            self.results,
            (),  # storage inboxes: the scheduler's alone (``send_storage``), one per worker
            time.monotonic(),
            os.getpid(),
            heartbeats=self.heartbeats,
            nic_busy=self.nic_busy,
            links=links,
            exchange_names=self._create_exchanges(tag, topo),
            weights=weights_digest(cfg, self.options.weight_seed, self.options.model_dir),
        )
        self.env = env
        crash = self.options.faults.crash_storage
        storage = [f"storage@node{n}" for n in range(topo.num_nodes)]
        for node in range(topo.num_nodes):
            self._spawn_storage(node, node == crash, self.options.faults.crash_storage_writes)
        for e in topo.engine_ids:  # in parallel: imports and model loading dominate start-up
            self._spawn_engine(e, first=True)
        regions = self._await_ready(set(storage), also=set(self.procs) - set(storage))
        self.env = env = replace(env, regions=tuple(regions[n] for n in storage))
        for e in topo.engine_ids:  # before any work message: FIFO inboxes
            self.engine_inbox[e].put(RegionsMsg(env.regions))
        self.engine_regions = self._await_ready(
            {topo.engine_name(e) for e in topo.engine_ids} - self._early_ready
        ) | {n: r for n, r in regions.items() if n not in storage}
        return env

    def _file_lock(self, name: str) -> LinkLock:
        assert self.link_dir is not None
        path = os.path.join(self.link_dir, f"{name}.lock")
        with open(path, "a"):  # exists before any process opens it
            pass
        return LinkLock(path)

    def _queue(self, name: str) -> Any:
        """A queue several processes write to, whose writers' lock survives a writer killed
        while holding it (a message under PIPE_BUF bytes is written in one atomic write)."""
        return DeathSafeQueue(self.ctx, self._file_lock(f"queue-{name}"))

    def _create_exchanges(self, tag: str, topo: Topology) -> tuple[str, ...]:
        """One shared-memory exchange segment per PE whose group has other PEs (sparse: only
        pages written are backed)."""
        names = []
        for e in topo.pe_ids:
            size = sum(1 for p in topo.pe_ids if topo.group_of(p) == topo.group_of(e))
            if size < 2:
                names.append("")
                continue
            shm = SharedMemory(name=f"{tag}-x{e}", create=True, size=region_bytes(size))
            self.exchanges.append(shm)
            names.append(shm.name)
        return tuple(names)

    def _spawn(self, name: str, target: Any, args: tuple[Any, ...]) -> bool:
        """Start child ``name``; False when the fork server died under the start (a new one
        runs now: the caller starts the child again, on a fresh inbox)."""
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        try:
            proc.start()
        except (EOFError, OSError):
            died = self.fork_server is not None and wait_gone(self.fork_server, 1.0)
            if not (died and self.check_fork_server()):
                raise
            return False
        self.procs[name] = proc
        self.idents[name] = ProcId.of(proc.pid)
        if self.fork_server is None:
            self.fork_server = self._current_fork_server()
        return True

    def _spawn_storage(
        self, node: int, crash_read: bool = False, crash_write: bool = False
    ) -> None:
        """Start node ``node``'s storage worker on a fresh inbox: no earlier worker of the
        node ever read it."""
        assert self.env is not None
        for _ in range(SPAWN_TRIES):
            gen = self.storage_generation.get(node, 0)
            self.storage_generation[node] = gen + 1
            inbox = self._queue(f"storage{node}-g{gen}")
            self.storage_inbox[node] = inbox
            args = (self.env, node, inbox, crash_read, crash_write)
            if self._spawn(f"storage@node{node}", storage_main, args):
                return
            discard_queue(inbox)
        raise RuntimeFailure(f"storage@node{node}: the fork server died at every start")

    def _spawn_engine(self, engine: int, first: bool) -> None:
        assert self.env is not None
        faults = self.options.faults
        crash_at = faults.crash_at_message if first and faults.crash_engine == engine else -1
        name = self.topology.engine_name(engine)
        for _ in range(SPAWN_TRIES):
            inbox = self.ctx.Queue()
            self.engine_inbox[engine] = inbox
            if self._spawn(name, engine_main, (self.env, engine, inbox, crash_at)):
                return
            discard_queue(inbox)
        raise RuntimeFailure(f"{name}: the fork server died at every start")

    def _await_ready(
        self, names: set[str], also: AbstractSet[str] = frozenset()
    ) -> dict[str, RegionHandle]:
        """Wait for every ``names`` ack; returns the regions they announced. Acks of ``also``
        (processes starting meanwhile) that arrive first are kept (``_early_ready``)."""
        regions: dict[str, RegionHandle] = {}
        deadline = time.monotonic() + self.options.ready_timeout_s
        waiting = set(names)
        while waiting:
            try:
                msg = self.results.get(timeout=READY_POLL_S)
            except queue.Empty:
                self._check_bootstrap(waiting | (set(also) - self._early_ready))
                if time.monotonic() > deadline:
                    raise RuntimeFailure(
                        f"not ready in time: {', '.join(sorted(waiting))}"
                    ) from None
                continue
            if isinstance(msg, ErrorMsg):
                raise RuntimeFailure(f"{msg.who} failed to start: {msg.text}")
            if isinstance(msg, ReadyMsg):
                waiting.discard(msg.who)
                if msg.who in also:
                    self._early_ready.add(msg.who)
                if msg.region is not None:
                    regions[msg.who] = msg.region
        return regions

    def _check_bootstrap(self, waiting: set[str]) -> None:
        """A child that died before its readiness ack fails the start at once (e.g. a script
        without an ``if __name__ == "__main__":`` guard, whose spawned children cannot start)."""
        for name in sorted(waiting):
            proc = self.procs.get(name)
            if proc is not None and not self._alive(name):
                raise RuntimeFailure(
                    f"{name} exited with code {proc.exitcode} during start-up (if this runs "
                    'from a script: guard its entry point with `if __name__ == "__main__":`)'
                )

    def _retire(self, name: str) -> None:
        """Take ``name`` out of service: SIGKILL it (whether it looked dead or stalled) and
        confirm it gone, before anything it held (inbox, slots, locks) is touched or handed on."""
        old, ident = self.procs.pop(name), self.idents.pop(name)
        if not kill_confirmed(ident):
            raise RuntimeFailure(f"{name} (pid {ident.pid}) did not die after SIGKILL")
        old.join(timeout=0.1)  # multiprocessing's bookkeeping (a dead fork server: at once)

    def respawn(self, engine: int) -> None:
        """Replace a dead engine; its readiness ack arrives on the results queue later."""
        name = self.topology.engine_name(engine)
        self._retire(name)
        discard_queue(self.engine_inbox.pop(engine))  # (a stalled one's may be full)
        assert self.env is not None
        self.heartbeats[self.env.heartbeat_slot(name)] = 0.0  # silent until its first beat
        self.engine_regions.pop(name, None)  # until the new incarnation announces its own
        self._spawn_engine(engine, first=False)

    def respawn_storage(self, node: int) -> None:
        """Replace node ``node``'s dead (or stalled) storage worker, on a fresh inbox. What
        the old inbox still held is dropped with it: the caller re-issues, from its own
        records, every read and write the dead worker had not answered."""
        assert self.env is not None
        if self.options.transport != "shm":  # shm regions are addressed by name: still valid
            raise RuntimeFailure(
                f"storage worker of node {node} died; respawn needs the shm transport "
                "(a new Mooncake endpoint would invalidate the engines' region handles)"
            )
        name = f"storage@node{node}"
        self._retire(name)
        discard_queue(self.storage_inbox.pop(node))
        self.heartbeats[self.env.heartbeat_slot(name)] = 0.0
        self._spawn_storage(node)

    def check_fork_server(self) -> bool:
        """Restart the fork server if it died (True then). Its children are left alone: they
        never depended on it (their liveness is read from /proc, their pipes are ours)."""
        if self.fork_server is None or is_running(self.fork_server):
            return False
        from multiprocessing import forkserver

        forkserver.ensure_running()  # reaps the dead one (our child), starts and preloads anew
        self.fork_server = self._current_fork_server()
        return True

    def _current_fork_server(self) -> ProcId | None:
        if self.ctx.get_start_method() != "forkserver":
            return None
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # (no public accessor)
        return None if pid is None else ProcId.of(pid)

    def send_storage(self, node: int, msg: Any) -> None:
        """Put ``msg`` in node ``node``'s storage worker's inbox (its current incarnation's)."""
        self.storage_inbox[node].put(msg)

    def send(self, engine: int, msg: Any) -> None:
        """Put ``msg`` in engine ``engine``'s inbox (its current incarnation's)."""
        self.engine_inbox[engine].put(msg)

    def buffer(self, node: int) -> SlotBuffer:
        """Node ``node``'s buffer (its slots are allocated and freed by the scheduler)."""
        return self.buffers[node]

    def announce_region(self, name: str, region: RegionHandle | None) -> None:
        """A respawned engine's readiness ack named its new exchange region."""
        if region is not None and name in self.procs:
            self.engine_regions[name] = region

    def exchange_peer(self, name: str) -> tuple[RegionHandle, int] | None:
        """Engine ``name``'s exchange region and pid, once it announced one (None: not yet,
        or a launcher without exchanges)."""
        region = self.engine_regions.get(name)
        return None if region is None else (region, self.procs[name].pid)

    def stalled(self, name: str) -> bool:
        """``name`` beat before but not within ``liveness_timeout_s`` (e.g. SIGSTOPped)."""
        if self.env is None:
            return False
        last = self.heartbeats[self.env.heartbeat_slot(name)]
        return last > 0 and self.env.clock.now() - last > self.options.liveness_timeout_s

    def _alive(self, name: str) -> bool:
        return is_running(self.idents[name])

    def _dead(self, name: str) -> bool:
        return not self._alive(name) or self.stalled(name)

    def dead_engines(self) -> list[int]:
        """Engines that exited or stopped beating (those are killed on ``respawn``)."""
        return [e for e in self.topology.engine_ids if self._dead(self.topology.engine_name(e))]

    def dead_workers(self) -> list[str]:
        return [n for n in sorted(self.procs) if n.startswith("storage") and self._dead(n)]

    def close(self) -> None:
        for inbox in self.storage_inbox.values():
            inbox.put(StopMsg())
        for inbox in self.engine_inbox.values():
            inbox.put(StopMsg())
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for name in sorted(self.procs):
            ident = self.idents[name]
            if not wait_gone(ident, max(0.0, deadline - time.monotonic())):
                kill_confirmed(ident)
            self.procs[name].join(timeout=0.1)
        for inbox in self.storage_inbox.values():
            discard_queue(inbox)
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()
        for shm in self.exchanges:
            shm.close()
            shm.unlink()
        self.exchanges.clear()
        if self.env is not None:
            for link in self.env.links:
                link.lock.close()
        if self.link_dir is not None:
            shutil.rmtree(self.link_dir, ignore_errors=True)
            self.link_dir = None

    def link_stats(self) -> dict[str, PacerStats]:
        """Bytes per class and busy time of every shared link so far: each engine's CNIC
        (``<engine>.tx`` / ``.rx``, charged by both ends of a transfer) and node DRAM."""
        if self.env is None or not self.env.links:
            return {}
        hw, topo, out = self.config.hardware, self.topology, {}
        for e in topo.engine_ids:
            tx, rx = self.env.links[2 * e], self.env.links[2 * e + 1]
            out[f"{topo.engine_name(e)}.tx"] = Pacer(hw.cnic_bytes_per_s, link=tx).stats
            out[f"{topo.engine_name(e)}.rx"] = Pacer(hw.cnic_bytes_per_s, link=rx).stats
        for n in range(topo.num_nodes):
            link = self.env.links[2 * len(topo.engine_ids) + n]
            out[f"dram@node{n}"] = Pacer(hw.dram_bytes_per_s, link=link).stats
        return out

    def nic_busy_s(self) -> dict[str, float]:
        """Busy seconds of every emulated NIC direction so far, as its pacer counted them
        (published by the processes every heartbeat)."""
        if self.env is None or self.nic_busy is None:
            return {}
        return dict(zip(self.env.nic_names(), list(self.nic_busy), strict=True))

    def pids(self) -> list[int]:
        return sorted(ident.pid for ident in self.idents.values())
