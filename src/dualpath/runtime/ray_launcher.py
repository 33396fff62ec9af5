"""The runtime on a Ray cluster: storage workers and engines as Ray actors placed per node.

Emulated node ``n`` is the Ray node that offers the custom resource ``dualpath_node<n>``
(``ray start --resources '{"dualpath_node3": 1}'``); without those resources, a placement
group with one bundle per emulated node spreads them over the Ray nodes. Control messages
travel as actor calls (``ray_actors``), KV bytes over the transport (tcp or mooncake), slot
allocation through each node's storage actor, and time on the shared wall clock. A dead
engine actor is replaced like a dead engine process (``Scheduler.recover`` re-queues its
requests). Same interface as ``Launcher``, so the scheduler and ``Runtime`` run on it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from dualpath.config import Config
from dualpath.deploy.ray_address import (
    RESOURCE_PREFIX,
    check_gcs_address,
    node_resource,
    require_ray,
)
from dualpath.kv.buffer import BufferSpec
from dualpath.kv.store import BlockLayout
from dualpath.ledger import Topology
from dualpath.runtime.env import ProcEnv, weights_digest
from dualpath.runtime.launcher import JOIN_TIMEOUT_S, Launcher, RuntimeFailure, check_kv_root
from dualpath.runtime.messages import StopMsg
from dualpath.runtime.options import RuntimeOptions, buffer_slots, startup_warning
from dualpath.types import EngineKind

RESOURCE_SHARE = 0.001  # of a node's marker resource per actor: any number fit on a node
MAILBOX_THREADS = 2
ACTOR_THREADS = 8  # concurrent calls into an engine / storage actor (its loop is one of them)
LOCAL_OBJECT_STORE_BYTES = 80 * 1024 * 1024  # a local instance: control messages only
LOCAL_TEMP_PARENT = "/tmp"  # short: Ray's Unix socket paths live under its temp dir
LOCAL_TEMP_PREFIX = "dpray-"


def check_address(address: str) -> None:
    """ValueError (one line) unless ``host:port`` accepts a TCP connection (Ray's GCS)."""
    check_gcs_address(address)


@contextlib.contextmanager
def ray_session(address: str, num_nodes: int) -> Iterator[Any]:
    """Connect to the cluster at ``address`` (or start a local Ray instance whose one node
    offers every emulated node's resource); shut down what this call started.

    A local instance is always a new one (never a cluster named by ``RAY_ADDRESS`` or by an
    address file an earlier ``ray start`` left) and lives in a private temp dir under
    ``/tmp``, removed at shutdown: it needs no ``/tmp/ray`` and leaves none."""
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    with contextlib.ExitStack() as started:
        if address:
            check_address(address)
            ray.init(address=address, logging_level="WARNING", log_to_driver=True)
        else:
            temp_dir = tempfile.mkdtemp(prefix=LOCAL_TEMP_PREFIX, dir=LOCAL_TEMP_PARENT)
            started.callback(shutil.rmtree, temp_dir, ignore_errors=True)
            ray.init(
                address="local",  # a new instance, whatever RAY_ADDRESS or /tmp/ray name
                num_cpus=os.cpu_count() or 1,
                resources={node_resource(n): 1.0 for n in range(num_nodes)},
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                _temp_dir=temp_dir,
                logging_level="WARNING",
            )
        started.callback(ray.shutdown)  # before the temp dir goes
        yield ray


class RayLauncher(Launcher):
    """``Launcher`` with Ray actors instead of local processes (see the module docstring)."""

    def __init__(self, config: Config, options: RuntimeOptions) -> None:
        if options.transport == "shm":
            raise ValueError("transport='shm' cannot cross nodes: use tcp or mooncake with Ray")
        faults = options.faults
        if faults.crash_mode != "exit" or faults.crash_storage >= 0 or faults.crash_storage_writes:
            raise ValueError(
                "runtime='ray' injects only engine exits (faults.crash_mode='exit'; "
                "crash_storage is not supported)"
            )
        self.config = config
        self.options = options
        self.topology = Topology.from_config(config)
        self.buffers: list[Any] = []  # RemoteSlots per node
        self.procs: dict[str, Any] = {}  # name → actor handle
        self.engine_inbox: dict[int, Any] = {}
        self.storage_inbox: dict[int, Any] = {}  # per node, its actor's (``send_storage``)
        self.fork_server = None  # actors: Ray starts and supervises the worker processes
        self.results: Any = None
        self.env: ProcEnv | None = None
        self.heartbeats = None
        # no cross-node shared memory: each PE of a group makes its own hidden-state exchange
        # region (``ProcEnv.own_exchange``, announced in its readiness ack); no shared NIC/DRAM
        # links (each actor paces its own), no published NIC busy times
        self.engine_regions: dict[str, Any] = {}
        self.nic_busy = None
        self._runs: dict[str, Any] = {}  # name → ObjectRef of the actor's main loop
        self._pids: dict[str, int] = {}
        self._early_ready: set[str] = set()  # ``Launcher._await_ready``'s; engines ack in ``run``
        self._mailbox: Any = None
        self._placement: list[dict[str, Any]] = []
        self._session: contextlib.ExitStack | None = None
        self._regions: tuple[Any, ...] = ()  # per node: its buffer as a transport region
        self._epoch_s = time.time()
        self._weights = ""  # weights_digest, computed at start

    # ------------------------------------------------------------------ placement
    def _place(self, ray: Any) -> list[dict[str, Any]]:
        """Per emulated node, the actor options that pin an actor there."""
        nodes = range(self.topology.num_nodes)
        have = ray.cluster_resources()
        if all(have.get(node_resource(n), 0) > 0 for n in nodes):
            return [{"resources": {node_resource(n): RESOURCE_SHARE}} for n in nodes]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        strategy = "STRICT_SPREAD" if alive >= self.topology.num_nodes else "SPREAD"
        pg = placement_group([{"CPU": 0.01}] * self.topology.num_nodes, strategy=strategy)
        if not pg.wait(self.options.ready_timeout_s):
            raise RuntimeFailure(
                f"Ray could not place {self.topology.num_nodes} nodes ({strategy}): "
                f"give the nodes resources {RESOURCE_PREFIX}0..{self.topology.num_nodes - 1}"
            )
        return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, n)} for n in nodes]

    def _actor(self, ray: Any, cls: type, node: int | None) -> Any:
        """``cls`` as a Ray actor class: no CPU reserved (the emulated engines limit their own
        threads), pinned to emulated node ``node`` (None: the driver's node)."""
        from dualpath.runtime.ray_actors import MAIL_GROUP

        opts: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            "max_concurrency": ACTOR_THREADS,  # the default group: loop, allocator, queries
        }
        if node is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = ray.get_runtime_context().get_node_id()
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
            opts["max_concurrency"] = MAILBOX_THREADS  # ``take`` waits; ``deliver`` does not
        else:
            opts.update(self._placement[node])
        return ray.remote(concurrency_groups={MAIL_GROUP: 1})(cls).options(**opts)

    # ------------------------------------------------------------------ start
    def start(self) -> ProcEnv:
        from dualpath.runtime.ray_actors import (
            ActorInbox,
            Mailbox,
            MailboxInbox,
            RemoteSlots,
            StorageActor,
        )

        topo, cfg, opts = self.topology, self.config, self.options
        check_kv_root(opts.kv_root)  # the driver's view of the shared KV mount
        self._session = contextlib.ExitStack()
        try:
            ray = self._session.enter_context(ray_session(opts.ray_address, topo.num_nodes))
        except ValueError as err:
            raise RuntimeFailure(str(err)) from None
        warning = startup_warning(opts)
        if warning:
            print(warning, file=sys.stderr)
        self._placement = self._place(ray)
        self._weights = weights_digest(cfg, opts.weight_seed, opts.model_dir)
        mailbox = self._actor(ray, Mailbox, None).remote()
        self._mailbox = mailbox
        self.results = MailboxInbox(mailbox)
        layout = BlockLayout(
            cfg.model.num_layers, cfg.scheduler.block_tokens, cfg.model.kv_bytes_per_token_per_layer
        )
        tag = f"dp{os.getpid()}-{uuid.uuid4().hex[:6]}"
        specs = tuple(
            BufferSpec(
                f"{tag}-n{n}",
                buffer_slots(cfg, opts, topo.kind_of_node(n) is EngineKind.PE),
                layout.full_block_bytes,
            )
            for n in range(topo.num_nodes)
        )
        storage = [
            self._actor(ray, StorageActor, n).remote(self._base_env(specs, ()), n)
            for n in range(topo.num_nodes)
        ]
        self.buffers = [RemoteSlots(a, specs[n]) for n, a in enumerate(storage)]
        env = replace(
            self._base_env(specs, tuple(ActorInbox(a) for a in storage)),
            slot_owners=tuple(self.buffers),
        )
        self.env = env
        self.storage_inbox = dict(enumerate(env.storage_inboxes))  # ``send_storage``
        for e in topo.engine_ids:  # built (torch, model) while the storage actors start
            self._new_engine(e, first=True)
        for n, actor in enumerate(storage):
            self._started(f"storage@node{n}", actor)
        regions = self._await_ready({f"storage@node{n}" for n in range(topo.num_nodes)})
        self._regions = tuple(regions[f"storage@node{n}"] for n in range(topo.num_nodes))
        self.env = env = replace(env, regions=self._regions)
        for e in topo.engine_ids:
            self._run_engine(e)
        self.engine_regions = self._await_ready({topo.engine_name(e) for e in topo.engine_ids})
        return env

    def _base_env(self, specs: tuple[BufferSpec, ...], inboxes: tuple[Any, ...]) -> ProcEnv:
        n = self.topology.num_nodes
        return ProcEnv(
            self.config,
            self.options,
            self.topology,
            specs,
            (None,) * n,
            self.results,
            inboxes,
            self._epoch_s,
            os.getpid(),
            wall_clock=True,
            weights=self._weights,
            own_exchange=True,
        )

    def exchange_peer(self, name: str) -> tuple[Any, int] | None:
        """Engine ``name``'s exchange region, pid 0: its actor may run on another host, where
        this host's ``/proc`` says nothing (a dead peer costs the exchange's timeout)."""
        region = self.engine_regions.get(name)
        return None if region is None else (region, 0)

    def _started(self, name: str, actor: Any) -> None:
        self.procs[name] = actor
        self._runs[name] = actor.run.remote()

    def _new_engine(self, engine: int, first: bool) -> None:
        import ray

        from dualpath.runtime.ray_actors import ActorInbox, EngineActor

        assert self.env is not None
        faults = self.options.faults
        crash_at = faults.crash_at_message if first and faults.crash_engine == engine else -1
        actor = self._actor(ray, EngineActor, self.topology.node_of(engine)).remote(
            self.env, engine, crash_at
        )
        self.engine_inbox[engine] = ActorInbox(actor)
        self.procs[self.topology.engine_name(engine)] = actor

    def _run_engine(self, engine: int) -> None:
        name = self.topology.engine_name(engine)
        self._runs[name] = self.procs[name].run.remote(self._regions)

    def _spawn_engine(self, engine: int, first: bool) -> None:
        self._new_engine(engine, first)
        self._run_engine(engine)

    def _check_bootstrap(self, waiting: set[str]) -> None:
        """An actor whose constructor or loop ended during start-up fails the start."""
        import ray

        for name in sorted(waiting):
            ref = self._runs.get(name)
            if ref is None:
                continue
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref)
                    why = "its loop returned"
                except Exception as err:  # the actor's error, as Ray reports it
                    why = _first_line(err)
                raise RuntimeFailure(f"{name} failed during start-up: {why}")

    # ------------------------------------------------------------------ liveness
    def _dead(self, name: str) -> bool:
        import ray

        done, _ = ray.wait([self._runs[name]], timeout=0)
        return bool(done)

    def stalled(self, name: str) -> bool:
        return False  # no heartbeats across hosts: Ray reports actor deaths itself

    def respawn(self, engine: int) -> None:
        import ray

        name = self.topology.engine_name(engine)
        old = self.procs.pop(name)
        self._runs.pop(name)
        ray.kill(old, no_restart=True)
        self._spawn_engine(engine, first=False)

    def respawn_storage(self, node: int) -> None:
        raise RuntimeFailure(
            f"storage actor of node {node} died; with runtime='ray' the run stops (its "
            "buffer's slots and in-flight reads went with it)"
        )

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        try:
            import ray
        except ImportError:
            return
        if ray.is_initialized() and self.procs:
            from dualpath.runtime.ray_actors import deliver

            for actor in self.procs.values():
                deliver(actor, StopMsg())
            ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=JOIN_TIMEOUT_S)
            for actor in [*self.procs.values(), self._mailbox]:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
        self.procs.clear()
        self._runs.clear()
        self.buffers.clear()
        if self._session is not None:
            self._session.close()
            self._session = None

    def pids(self) -> list[int]:
        import ray

        for name, actor in self.procs.items():
            if name not in self._pids:
                with contextlib.suppress(Exception):
                    self._pids[name] = ray.get(actor.pid.remote(), timeout=5.0)
        return sorted(self._pids.values())


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[-1] if lines else type(err).__name__
