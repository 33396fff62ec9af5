"""Ray actor bodies of the runtime: a node's storage worker, an engine, the results mailbox.

Each actor runs the same main loop as its local process (``StorageWorker.serve``,
``Engine.serve``) on a plain ``queue.Queue`` inbox that peers fill through ``deliver``, which
runs in its own one-thread concurrency group (``MAIL_GROUP``): a sender's messages arrive and
are queued in the order it sent them, as on a multiprocessing queue. The storage actor owns its node's buffer and
is the only allocator of its slots (``alloc`` / ``free`` are actor calls). Imported only in
Ray workers and by the Ray launcher; never calls the scheduler.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import replace
from typing import Any

from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.transport import KV_HOST_ENV
from dualpath.kv.transport.base import RegionHandle
from dualpath.runtime.env import ProcEnv

ALLOC_POLL_S = 0.002
MAIL_GROUP = "mail"  # the one-thread concurrency group of every actor's ``deliver``


def deliver(handle: Any, msg: Any) -> None:
    """Send ``msg`` to the actor ``handle`` (asynchronous, in order per sender)."""
    handle.deliver.options(concurrency_group=MAIL_GROUP).remote(msg)


class ActorInbox:
    """The sending end of an actor's inbox (picklable: travels inside ``ProcEnv``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def put(self, msg: Any) -> None:
        deliver(self.handle, msg)


class MailboxInbox:
    """The scheduler's inbox: every process ``put``s here; the driver ``get``s in batches
    (one round trip fetches everything that has arrived)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._got: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self.handle}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.handle, self._got = state["handle"], []

    def put(self, msg: Any) -> None:
        deliver(self.handle, msg)

    def get(self, timeout: float | None = None) -> Any:
        import ray

        if not self._got:
            self._got = ray.get(self.handle.take.remote(timeout or 0.0))
            self._got.reverse()
        if not self._got:
            raise queue.Empty
        return self._got.pop()

    def get_nowait(self) -> Any:
        return self.get(0.0)


class RemoteSlots:
    """A node's buffer as its other processes see it: slots allocated by the storage actor
    that owns it (same methods as ``SlotBuffer``'s allocator; no bytes)."""

    def __init__(self, handle: Any, spec: BufferSpec) -> None:
        self.handle = handle
        self.spec = spec

    def alloc(self, num_slots: int) -> list[int] | None:
        import ray

        got: list[int] | None = ray.get(self.handle.alloc.remote(num_slots))
        return got

    def alloc_wait(
        self, num_slots: int, timeout_s: float, poll_s: float = ALLOC_POLL_S
    ) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while (got := self.alloc(num_slots)) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"buffer {self.spec.name}: no {num_slots} free slots")
            time.sleep(poll_s)
        return got

    def free(self, slots: list[int]) -> None:
        import ray

        ray.get(self.handle.free.remote(list(slots)))

    @property
    def num_free(self) -> int:
        import ray

        n: int = ray.get(self.handle.num_free.remote())
        return n

    def close(self) -> None:
        """Nothing to detach: the owner unlinks the buffer."""


def _actor_env(env: ProcEnv) -> ProcEnv:
    """The env inside an actor: its parent is its raylet; transports serve on the address
    of its Ray node (loopback in tests, the cluster network on a cluster)."""
    import ray

    os.environ[KV_HOST_ENV] = ray.util.get_node_ip_address()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return replace(env, parent_pid=os.getppid())


class Mailbox:
    """The scheduler's inbox, on the driver's node."""

    def __init__(self) -> None:
        self._q: queue.Queue[Any] = queue.Queue()

    def deliver(self, msg: Any) -> None:
        self._q.put(msg)

    def take(self, timeout_s: float) -> list[Any]:
        """Everything queued; waits up to ``timeout_s`` for the first message."""
        try:
            out = [self._q.get(timeout=timeout_s) if timeout_s > 0 else self._q.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


class StorageActor:
    """Node ``node``'s storage worker; creates and owns the node's buffer."""

    def __init__(self, env: ProcEnv, node: int) -> None:
        from dualpath.runtime.storage import StorageWorker, write_faults

        env = _actor_env(env)
        lock = threading.Lock()  # every allocation of this node runs in this process
        self._owner = SlotBuffer.create(env.buffers[node], lock)
        locks = tuple(lock if n == node else None for n in range(len(env.buffers)))
        self.worker = StorageWorker(
            replace(env, locks=locks, slot_owners=()), node, write_faults(env)
        )
        self.inbox: queue.Queue[Any] = queue.Queue()

    def pid(self) -> int:
        return os.getpid()

    def deliver(self, msg: Any) -> None:
        self.inbox.put(msg)

    def run(self) -> None:
        from dualpath.runtime.messages import ErrorMsg

        try:
            self.worker.serve(self.inbox)
        except Exception as err:  # report, then end: the scheduler shuts the run down
            self.worker.env.results.put(ErrorMsg(self.worker.name, f"{type(err).__name__}: {err}"))
            raise
        finally:
            self._owner.close()  # unlinks the segment

    def region(self) -> RegionHandle:
        return self.worker.region

    def alloc(self, num_slots: int) -> list[int] | None:
        return self.worker.buffer.alloc(num_slots)

    def free(self, slots: list[int]) -> None:
        self.worker.buffer.free(slots)

    def num_free(self) -> int:
        return self.worker.buffer.num_free


class EngineActor:
    """Engine ``engine_id`` (PE or DE by id); the same class as a local engine process. It is
    built while the storage actors start; ``run`` gets their buffers' regions."""

    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        env = _actor_env(env)
        self.env, self.engine_id = env, engine_id
        if env.topology.is_pe(engine_id):
            from dualpath.runtime.pe_engine import PrefillEngine

            self.engine: Any = PrefillEngine(env, engine_id, crash_at)
        else:
            from dualpath.runtime.de_engine import DecodeEngine

            self.engine = DecodeEngine(env, engine_id, crash_at)
        self.inbox: queue.Queue[Any] = queue.Queue()

    def pid(self) -> int:
        return os.getpid()

    def deliver(self, msg: Any) -> None:
        self.inbox.put(msg)

    def run(self, regions: tuple[RegionHandle, ...]) -> None:
        from dualpath.runtime.messages import ErrorMsg

        self.engine.env = self.env = replace(self.env, regions=regions)
        try:
            self.engine.serve(self.inbox)
        except Exception as err:
            name = self.env.topology.engine_name(self.engine_id)
            self.env.results.put(ErrorMsg(name, f"{type(err).__name__}: {err}"))
            raise
