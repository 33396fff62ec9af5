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
import sys
from pathlib import Path
from typing import Any

from dualpath.deploy.ray_address import (
    RESOURCE_PREFIX,
    check_gcs_address,
    node_resource,
    require_ray,
)
from dualpath.integrations.vllm.node import NodeSpec
from dualpath.integrations.vllm.token import write_token_file

RESOURCE_SHARE = 0.001  # of a node's marker resource: the host actor takes almost none
CALL_TIMEOUT_S = 30.0  # an actor call that takes longer: its node is taken as lost
DEAD = -signal.SIGKILL  # the exit code of a process whose node's actor is gone
LOG_TAIL_BYTES = 64 * 1024


class NodeHost:
    """The processes of one node, on that node (a Ray actor: ``RayPlacer`` wraps it)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.made: list[str] = []  # folders this host made on its machine (``cleanup``)

    def prepare(self, run_dir: str, token_file: str, token: str) -> None:
        """The deployment's run folder on this machine (its side-car's lock file, sockets) and
        the token file its processes read, mode 0600: the driver's own are on its machine."""
        run = Path(run_dir)
        if not run.exists():
            run.mkdir(parents=True, mode=0o700)
            self.made.append(run_dir)
        if not Path(token_file).exists():
            write_token_file(Path(token_file), token)

    def cleanup(self) -> None:
        """Remove what ``prepare`` made (its processes are stopped by then)."""
        import shutil

        for folder in self.made:
            shutil.rmtree(folder, ignore_errors=True)
        self.made.clear()

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

    # a name this host never started (a host made anew after one was lost) reads as exited

    def poll(self, name: str) -> int | None:
        p = self.procs.get(name)
        return DEAD if p is None else p.poll()

    def wait(self, name: str, timeout_s: float) -> int | None:
        p = self.procs.get(name)
        if p is None:
            return DEAD
        with contextlib.suppress(subprocess.TimeoutExpired):
            return p.wait(timeout=timeout_s)
        return None

    def kill_group(self, name: str, sig: int) -> None:
        from dualpath.integrations.vllm.processes import kill_group

        p = self.procs.get(name)
        if p is not None:
            kill_group(p, sig)

    def kill_all(self) -> None:
        """SIGKILL every process group it started (before it is replaced or removed)."""
        for name in list(self.procs):
            self.kill_group(name, signal.SIGKILL)

    def segments(self, name: str) -> list[str]:
        from dualpath.integrations.vllm.processes import group_segments

        p = self.procs.get(name)
        return [] if p is None else sorted(group_segments(p.pid))

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
    """A process that a node's host actor started, with ``subprocess.Popen``'s view. It asks
    the actor that started it: once that actor is gone, the process reads as killed
    (``DEAD``); an actor that is only slow to answer leaves it running (``poll``: None)."""

    def __init__(self, placer: RayPlacer, node: int, actor: Any, name: str, pid: int) -> None:
        self.placer, self.node, self.actor, self.name, self.pid = placer, node, actor, name, pid
        self.returncode: int | None = None

    def _ask(self, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        return self.placer.ask_actor(self.actor, self.node, method, *args, timeout_s=timeout_s)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._ask("poll", self.name)
            except NodeLost:
                self.returncode = DEAD
            except NodeSlow:
                return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        limit = CALL_TIMEOUT_S if timeout is None else timeout
        while self.returncode is None:
            step = min(limit, 5.0)
            try:
                self.returncode = self._ask("wait", self.name, step, timeout_s=step + 10.0)
            except NodeLost:
                self.returncode = DEAD
            except NodeSlow:
                pass
            if self.returncode is None:
                limit -= step
                if limit <= 0:
                    raise subprocess.TimeoutExpired(self.name, timeout or CALL_TIMEOUT_S)
        return self.returncode

    def kill_group(self, sig: int) -> None:
        with contextlib.suppress(NodeLost):  # its host is gone: nothing to signal through it
            self._ask("kill_group", self.name, int(sig), timeout_s=CALL_TIMEOUT_S + 15.0)
        if sig == signal.SIGKILL:
            self.poll()

    def segments(self) -> set[str]:
        try:
            return set(self._ask("segments", self.name))
        except (NodeLost, NodeSlow):
            return set()

    def unlink_unmapped(self, names: set[str]) -> list[str]:
        try:
            return list(self._ask("unlink_unmapped", sorted(names)))
        except (NodeLost, NodeSlow):
            return []


class NodeLost(OSError):
    """A node's host actor is gone (it died, or its raylet did)."""


class NodeSlow(OSError):
    """A node's host actor did not answer in time (it may still)."""


class RayPlacer:
    """A host actor per node, on the Ray node offering that node's resource; each prepared
    with the deployment's run folder and token file on its machine (``prepare``)."""

    def __init__(self, address: str, nodes: list[int]) -> None:
        self.ray = require_ray()
        check_gcs_address(address)
        self._started = not self.ray.is_initialized()
        self.actors: dict[int, Any] = {}
        self._prepared: tuple[str, str, str] | None = None
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
        self.actors = {n: self._new_actor(n) for n in nodes}

    def _new_actor(self, node: int) -> Any:
        actor = self._actor_cls.options(resources={node_resource(node): RESOURCE_SHARE}).remote()
        if self._prepared is not None:
            self.ask_actor(actor, node, "prepare", *self._prepared, timeout_s=120.0)
        return actor

    def ask_actor(
        self, actor: Any, node: int, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S
    ) -> Any:
        """``method(*args)`` on host actor ``actor`` of node ``node``: NodeLost if the actor is
        gone, NodeSlow if it did not answer in ``timeout_s``, RuntimeError (one line) if the
        call failed there."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return self.ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
        except RayActorError as err:
            raise NodeLost(f"node {node}'s Ray host is gone: {type(err).__name__}") from None
        except GetTimeoutError:
            raise NodeSlow(f"node {node}'s Ray host: no answer in {timeout_s:g} s") from None
        except RayTaskError as err:
            cause = err.cause if getattr(err, "cause", None) is not None else err
            first = str(cause).strip().splitlines()[:1]
            raise RuntimeError(
                f"node {node} ({method}): {type(cause).__name__}: {first[0] if first else ''}"
            ) from None

    def ask(self, node: int, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """``ask_actor`` on node ``node``'s current host actor."""
        return self.ask_actor(self.actors[node], node, method, *args, timeout_s=timeout_s)

    def prepare(self, run_dir: str, token_file: str, token: str) -> None:
        """Every node's machine gets ``run_dir`` and the token file (as every later host)."""
        self._prepared = (run_dir, token_file, token)
        for node in self.actors:
            self.ask(node, "prepare", *self._prepared, timeout_s=120.0)

    def address(self, node: int) -> str:
        """The address of the machine node ``node`` runs on (its raylet's)."""
        return str(self.ask(node, "address", timeout_s=120.0))

    def start(
        self, node: int, name: str, cmd: list[str], env: dict[str, str] | None, log_path: str
    ) -> RayProc:
        """Start ``cmd`` on node ``node``'s machine; a host actor that is gone is replaced
        (the processes it started read as killed)."""
        try:
            pid = self.ask(node, "start", name, cmd, env, log_path)
        except NodeLost:
            with contextlib.suppress(Exception):
                self.ray.kill(self.actors[node])
            self.actors[node] = self._new_actor(node)
            pid = self.ask(node, "start", name, cmd, env, log_path, timeout_s=120.0)
        return RayProc(self, node, self.actors[node], name, int(pid))

    def unlink_buffer(self, spec: NodeSpec) -> None:
        with contextlib.suppress(NodeLost, NodeSlow):
            self.ask(spec.node, "unlink_buffer", spec.to_json())

    def read_text(self, node: int, path: str) -> str:
        try:
            return str(self.ask(node, "read_text", path))
        except (NodeLost, NodeSlow, RuntimeError):
            return ""

    def close(self) -> None:
        """Every host's processes killed (``Launched.stop`` stopped them gently before), its
        folders removed, the actors gone, and Ray disconnected if this started it."""
        for node, actor in self.actors.items():
            for method in ("kill_all", "cleanup"):
                try:
                    self.ask_actor(actor, node, method, timeout_s=CALL_TIMEOUT_S + 15.0)
                except (NodeLost, NodeSlow, RuntimeError) as err:
                    print(f"dualpath: {err}", file=sys.stderr)
                    break
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        self.actors = {}
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
