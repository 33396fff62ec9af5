"""A deployment over vLLM placed by Ray (``serve --engine vllm --runtime ray --ray-address``):
node ``n``'s side-car and vLLM instance start on the Ray node that offers the custom resource
``dualpath_node<n>`` (``ray start --resources '{"dualpath_node3": 1}'``, as our own runtime's
actors are placed, and as ``dualpath cluster ray`` starts one raylet per namespace), the router
on the driver's host (the head).

On each node one small actor (``NodeHost``, no CPU) starts the node's processes as ordinary
processes of that machine, each leading a process group of its own, and answers for them:
whether one exited, its group signalled, the shared memory its group maps, a log's tail, a
buffer a killed side-car left. ``RayProc`` is a process so started, as the supervisor sees
one (``subprocess.Popen``'s ``pid`` / ``poll`` / ``wait`` / ``returncode``): the supervision
rules are the same as on one host (``supervise.py``). A node's actor that dies (its raylet
gone) reads as its processes' death; the next start on that node makes a new actor, and once
a process died more often than the restart budget allows, the deployment exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from dualpath.deploy.ray_address import (
    RESOURCE_PREFIX,
    check_gcs_address,
    node_resource,
    require_ray,
)
from dualpath.integrations.vllm.node import NodeSpec

RESOURCE_SHARE = 0.001  # of a node's marker resource: the host actor takes almost none
CALL_TIMEOUT_S = 30.0  # an actor call that takes longer: its node is taken as lost
DEAD = -signal.SIGKILL  # the exit code of a process whose node's actor is gone
LOG_TAIL_BYTES = 64 * 1024


class NodeHost:
    """The processes of one node, on that node (a Ray actor: ``RayPlacer`` wraps it)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None, log_path: str) -> int:
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:  # a restart appends
            p = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = p
        return p.pid

    def poll(self, name: str) -> int | None:
        return self.procs[name].poll()

    def wait(self, name: str, timeout_s: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.procs[name].wait(timeout=timeout_s)
        return None

    def kill_group(self, name: str, sig: int) -> None:
        from dualpath.integrations.vllm.processes import kill_group

        kill_group(self.procs[name], sig)

    def segments(self, name: str) -> list[str]:
        from dualpath.integrations.vllm.processes import group_segments

        return sorted(group_segments(self.procs[name].pid))

    def unlink_unmapped(self, names: list[str]) -> list[str]:
        from dualpath.integrations.vllm.processes import unlink_unmapped

        return unlink_unmapped(set(names))

    def unlink_buffer(self, spec_json: str) -> None:
        from dualpath.integrations.vllm.processes import unlink_buffer

        unlink_buffer(NodeSpec.from_json(spec_json))

    def read_text(self, path: str) -> str:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class RayProc:
    """A process that node ``node``'s host actor started, with ``subprocess.Popen``'s view."""

    def __init__(self, placer: RayPlacer, node: int, name: str, pid: int) -> None:
        self.placer, self.node, self.name, self.pid = placer, node, name, pid
        self.returncode: int | None = None

    def _ask(self, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return self.placer.ask(self.node, method, self.name, *args, timeout_s=timeout_s)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._ask("poll")
            except NodeLost:
                self.returncode = DEAD
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        limit = CALL_TIMEOUT_S if timeout is None else timeout
        while self.returncode is None:
            try:
                self.returncode = self._ask("wait", min(limit, 5.0), timeout_s=limit + 10.0)
            except NodeLost:
                self.returncode = DEAD
            if self.returncode is None:
                limit -= 5.0
                if limit <= 0:
                    raise subprocess.TimeoutExpired(self.name, timeout or CALL_TIMEOUT_S)
        return self.returncode

    def kill_group(self, sig: int) -> None:
        with contextlib.suppress(NodeLost):  # its node is gone: so are its processes
            self._ask("kill_group", int(sig), timeout_s=CALL_TIMEOUT_S + 15.0)
        if sig == signal.SIGKILL:
            self.poll()

    def segments(self) -> set[str]:
        try:
            return set(self._ask("segments"))
        except NodeLost:
            return set()

    def unlink_unmapped(self, names: set[str]) -> list[str]:
        try:
            return list(self.placer.ask(self.node, "unlink_unmapped", sorted(names)))
        except NodeLost:
            return []


class NodeLost(Exception):
    """A node's host actor did not answer (it died, or its raylet is gone)."""


class RayPlacer:
    """A host actor per node, on the Ray node offering that node's resource (``place``)."""

    def __init__(self, address: str, nodes: list[int]) -> None:
        self.ray = require_ray()
        check_gcs_address(address)
        self._started = not self.ray.is_initialized()
        if self._started:
            self.ray.init(
                address=address, logging_level="WARNING", log_to_driver=False, namespace="dualpath"
            )
        have = self.ray.cluster_resources()
        missing = [node_resource(n) for n in nodes if have.get(node_resource(n), 0) <= 0]
        if missing:
            self.close()
            raise ValueError(
                f"the Ray cluster at {address} offers no {', '.join(missing)}: start node n's "
                f"raylet with --resources '{{\"{RESOURCE_PREFIX}n\": 1}}' (dualpath cluster ray "
                "does), one per node"
            )
        self._actor_cls = self.ray.remote(num_cpus=0, max_restarts=0)(NodeHost)
        self.actors: dict[int, Any] = {n: self._new_actor(n) for n in nodes}

    def _new_actor(self, node: int) -> Any:
        return self._actor_cls.options(resources={node_resource(node): RESOURCE_SHARE}).remote()

    def ask(self, node: int, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """``method(*args)`` on node ``node``'s host actor; NodeLost if it cannot answer."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return self.ray.get(getattr(self.actors[node], method).remote(*args), timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as err:
            raise NodeLost(f"node {node}'s Ray host: {type(err).__name__}") from None

    def address(self, node: int) -> str:
        """The address of the machine node ``node`` runs on (its raylet's)."""
        return str(self.ask(node, "address", timeout_s=120.0))

    def start(
        self, node: int, name: str, cmd: list[str], env: dict[str, str] | None, log_path: str
    ) -> RayProc:
        """Start ``cmd`` on node ``node``'s machine; a host actor that died is replaced."""
        try:
            pid = self.ask(node, "start", name, cmd, env, log_path)
        except NodeLost:
            with contextlib.suppress(Exception):
                self.ray.kill(self.actors[node])
            self.actors[node] = self._new_actor(node)
            pid = self.ask(node, "start", name, cmd, env, log_path, timeout_s=120.0)
        return RayProc(self, node, name, int(pid))

    def unlink_buffer(self, spec: NodeSpec) -> None:
        with contextlib.suppress(NodeLost):
            self.ask(spec.node, "unlink_buffer", spec.to_json())

    def read_text(self, node: int, path: str) -> str:
        try:
            return str(self.ask(node, "read_text", path))
        except NodeLost:
            return ""

    def close(self) -> None:
        """The host actors gone (their processes stopped before: ``Launched.stop``)."""
        for actor in getattr(self, "actors", {}).values():
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()


def placement_note(placer: RayPlacer, nodes: list[int]) -> str:
    """One line naming each node's machine (the start-up message)."""
    return ", ".join(f"node {n} on {placer.address(n)}" for n in nodes)
