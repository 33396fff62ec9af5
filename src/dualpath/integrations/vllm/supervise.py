"""Supervision of a deployment's processes (``processes.Launched``): a vLLM instance or side-car
that dies is killed with its whole process group and started again with the same command and
port, while the router reports it down (``/health`` 503, requests that need it a 503 at once).

A side-car owns its node's buffer (shared memory that the router and the vLLM workers map): its
restart recreates the buffer, so every process that mapped the old one is renewed too — the
instance of its node, and for a DE node every prefill instance (they save into, and on the DE
read path load from, its buffer) — and the router's flow re-attaches it (``reattach``) once no
request holds the node. A dead instance's slots are freed by its owner tag
(``node.instance_owner``) once its group is gone, and the shared memory of its own that it
could not unlink (vLLM's message queues) is unlinked. Each process restarts at most
``max_restarts`` times; one death more, or a restart that does not come up, ends the
deployment (``on_fatal``: it exits non-zero).
Owns no request: the router ends those that need what died (``Availability.lose``).
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx

from dualpath.integrations.vllm.node import RemoteSlots, call, instance_owner
from dualpath.integrations.vllm.processes import (
    Launched,
    kill_group,
    proc_segments,
    unlink_unmapped_of,
)
from dualpath.kv.buffer import SlotBuffer

POLL_S = 0.2  # how often the processes are looked at
# a restart waits this long first: the requests that used what died end before its buffer or
# process is replaced, and a crash loop is not a busy loop
BACKOFF_S = 1.0
DRAIN_S = 10.0  # a side-car's buffer is replaced once no request holds its node, or after this


class Availability(Protocol):
    """What the router exposes to the supervisor (``router.Router``)."""

    def lose(self, component: str, nodes: Sequence[int], reason: str) -> None: ...

    def restore(self, component: str) -> None: ...

    def holds(self, node: int) -> bool: ...


class Buffers(Protocol):
    """The router's flow (``flow.TurnFlow``): its node buffers, and ``reattach`` after a
    side-car recreated one."""

    buffers: dict[int, SlotBuffer | RemoteSlots]

    def reattach(self, node: int) -> None: ...


class Fatal(Exception):
    """The deployment cannot go on: a process died too often or did not come back."""


class Supervisor:
    """Looks at every process each ``poll_s``; restarts what died (``run``, an asyncio task
    in the router's event loop)."""

    def __init__(
        self,
        launched: Launched,
        router: Availability,
        flow: Buffers,
        startup_timeout_s: float,
        max_restarts: int,
        on_fatal: Callable[[str], None],
        poll_s: float = POLL_S,
        backoff_s: float = BACKOFF_S,
        restarts: Counter[str] | None = None,
    ) -> None:
        """``restarts``: where the restarts per process are counted (``/metrics`` reads it)."""
        self.launched, self.router, self.flow = launched, router, flow
        self.dep = launched.deployment
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.on_fatal = on_fatal
        self.poll_s, self.backoff_s = poll_s, backoff_s
        self.restarts: Counter[str] = restarts if restarts is not None else Counter()
        self.segments: dict[int, set[str]] = {}  # instance → its /dev/shm segments

    def name(self, kind: str, index: int) -> str:
        if kind == "sidecar":
            return f"the side-car of node {self.dep.nodes[index].node}"
        inst = self.dep.instances[index]
        role = "prefill" if inst.kind == "pe" else "decode"
        return f"the vLLM {role} instance on node {inst.node}"

    def dead(self) -> list[tuple[str, int]]:
        """The processes that exited (side-cars first)."""
        return [
            ("sidecar", i) for i, p in enumerate(self.launched.sidecars) if p.poll() is not None
        ] + [("instance", i) for i, p in enumerate(self.launched.instances) if p.poll() is not None]

    def dependents(self, node: int) -> list[int]:
        """The instances that map node ``node``'s buffer: its own, and every prefill instance
        when it is a DE node."""
        de = self.dep.nodes[node].kind == "de"
        return [
            j
            for j, inst in enumerate(self.dep.instances)
            if inst.node == node or (de and inst.kind == "pe")
        ]

    def _note_segments(self, j: int) -> None:
        self.segments[j] = proc_segments(self.launched.instances[j])

    async def run(self) -> None:
        try:
            for j in range(len(self.launched.instances)):
                await asyncio.to_thread(self._note_segments, j)
            while True:
                await asyncio.sleep(self.poll_s)
                # (a process on another machine is asked through Ray: off the event loop)
                dead = await asyncio.to_thread(self.dead)
                if dead:
                    await self.recover(dead)
        except Exception as err:  # Fatal, or a bug here: nothing restarts what dies any more
            reason = (
                str(err)
                if isinstance(err, Fatal)
                else (f"the supervisor failed: {type(err).__name__}: {err}")
            )
            self.router.lose("deployment", [n.node for n in self.dep.nodes], reason)
            print(f"dualpath: {reason}", file=sys.stderr, flush=True)
            self.on_fatal(reason)

    def _lose(self, kind: str, index: int, reason: str) -> None:
        node = self.dep.nodes[index].node if kind == "sidecar" else self.dep.instances[index].node
        self.router.lose(self.name(kind, index), [node], reason)

    async def recover(self, dead: list[tuple[str, int]]) -> None:
        """Restart what died: side-cars (with the instances that map their buffers), then
        instances; each back in the router once it answers."""
        procs = {"sidecar": self.launched.sidecars, "instance": self.launched.instances}
        for kind, i in dead:
            name = self.name(kind, i)
            self._lose(
                kind, i, f"{name} exited with code {procs[kind][i].returncode}; restarting it"
            )
        for j in [i for kind, i in dead if kind == "instance"]:  # what a dead one leaves
            await self._clean_up(j)
        for kind, i in dead:
            name = self.name(kind, i)
            self.restarts[name] += 1
            if self.restarts[name] > self.max_restarts:
                raise Fatal(
                    f"{name} exited with code {procs[kind][i].returncode} (restarted "
                    f"{self.max_restarts} times already): the deployment stops"
                )
        await asyncio.sleep(self.backoff_s)
        instances = sorted({i for kind, i in dead if kind == "instance"})
        sidecars = [i for kind, i in dead if kind == "sidecar"]
        for i in sidecars:
            for j in self.dependents(self.dep.nodes[i].node):
                if j not in instances:
                    self._lose(
                        "instance",
                        j,
                        f"restarting with {self.name('sidecar', i)} (it maps that node's buffer)",
                    )
                    await self._clean_up(j)
                    instances.append(j)
        for i in sidecars:
            await self._restart_sidecar(i)
        for j in instances:  # (on another machine: a call through Ray, off the event loop)
            await asyncio.to_thread(self.launched.start_instance, j)
        await asyncio.gather(*(self._await_instance(j) for j in instances))

    async def _clean_up(self, j: int) -> None:
        """Instance ``j``'s whole group killed (its leader may be gone, its EngineCore not),
        then the slots and the shared memory it held freed."""
        proc = self.launched.instances[j]
        await asyncio.to_thread(kill_group, proc)
        await asyncio.to_thread(self._free_held, j)  # (a remote buffer: a side-car call each)
        await asyncio.to_thread(unlink_unmapped_of, proc, self.segments.pop(j, set()))

    def _free_held(self, j: int) -> None:
        """The slots instance ``j`` held in any buffer (by its owner tag): free, now that no
        process of it is left."""
        tag = instance_owner(self.dep.instances[j].node)
        for node, buf in sorted(self.flow.buffers.items()):
            try:
                buf.release_owner(tag)
            except (ValueError, OSError):  # a buffer closed by a re-attach, a side-car gone
                print(
                    f"dualpath: node {node}'s buffer: cannot free the slots of "
                    f"{self.name('instance', j)}",
                    file=sys.stderr,
                )

    async def _restart_sidecar(self, i: int) -> None:
        spec = self.dep.nodes[i]
        await asyncio.to_thread(kill_group, self.launched.sidecars[i])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        while self.router.holds(spec.node) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        proc = await asyncio.to_thread(self.launched.start_sidecar, i)
        deadline = loop.time() + self.startup_timeout_s
        while True:
            if await asyncio.to_thread(proc.poll) is not None:
                return  # died again: the next look restarts it (within its budget)
            try:
                await asyncio.to_thread(call, spec.control, {"op": "ping"}, 1.0)
                break
            except OSError:
                if loop.time() > deadline:
                    raise Fatal(
                        f"{self.name('sidecar', i)} not ready "
                        f"{self.startup_timeout_s:g} s after its restart"
                    ) from None
                await asyncio.sleep(0.05)
        self.flow.reattach(spec.node)
        self.router.restore(self.name("sidecar", i))

    async def _await_instance(self, j: int) -> None:
        proc, inst = self.launched.instances[j], self.dep.instances[j]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while loop.time() < deadline:
                if await asyncio.to_thread(proc.poll) is not None:
                    return  # died again: the next look restarts it (within its budget)
                try:
                    if (await client.get(inst.url + "/health")).status_code == 200:
                        await asyncio.to_thread(self._note_segments, j)
                        self.router.restore(self.name("instance", j))
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise Fatal(
            f"{self.name('instance', j)} not ready {self.startup_timeout_s:g} s after its restart"
        )
