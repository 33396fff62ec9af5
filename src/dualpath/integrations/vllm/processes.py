"""The processes of one deployment over vLLM (``Launched``): side-cars and instances, each
leading a process group of its own, started and restarted with their recorded commands,
stopped by signalling their whole group (an instance's EngineCore and workers are in it),
whether its leader is still there or not; and the shared memory a killed process leaves.
Starts nothing by itself: ``launch.py`` and ``supervise.py`` call it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import IO, Any

from dualpath.integrations.vllm.node import NodeSpec
from dualpath.integrations.vllm.setup import Deployment

GROUP_EXIT_S = 10.0  # a SIGKILLed group's members are gone within this (else: a warning)


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies left out) of process group ``pgid``, from ``/proc``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(stat.parent.name))
    return sorted(out)


def kill_group(proc: Any, sig: int = signal.SIGKILL) -> None:
    """Signal ``proc``'s whole process group (its id is the leader's pid: every process here
    starts a session of its own) even when the leader has exited, reap the leader, and, for
    SIGKILL, wait until no member is left. A process on another machine (``rayhost.RayProc``)
    is signalled there."""
    if not isinstance(proc, subprocess.Popen):
        proc.kill_group(sig)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    if sig != signal.SIGKILL:
        return
    proc.wait()
    deadline = time.monotonic() + GROUP_EXIT_S
    while (left := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        print(
            f"dualpath: process group {proc.pid}: {left} still there after SIGKILL", file=sys.stderr
        )


# Python's anonymous shared memory and semaphores, and the segments a tensor- or pipeline-
# parallel vLLM CPU instance shares among its ranks (``vllm_dist_<id>-tp:0-[0-1]-cpushm_<r>``):
# an instance killed, or even stopped, leaves them behind
_SEGMENT = re.compile(r"(?:psm_|sem\.mp-)[\w-]+|vllm_dist_[\w:\[\]-]+")


def _mapped_inodes(pids: list[int]) -> set[int]:
    """Inodes of the ``/dev/shm`` files processes ``pids`` map. By inode, not name: glibc
    creates a named semaphore under a temporary name, maps it, then links it to its own
    name and removes the temporary one, so a live semaphore shows in ``/proc/<pid>/maps``
    only as ``/dev/shm/sem.XXXXXX (deleted)``, with its inode."""
    out: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    out.add(int(fields[4]))
    return out


def _mapped_segments(pids: list[int]) -> set[str]:
    """The multiprocessing and vLLM segments in ``/dev/shm`` that processes ``pids`` map."""
    inodes = _mapped_inodes(pids)
    out: set[str] = set()
    for entry in Path("/dev/shm").iterdir():
        if _SEGMENT.fullmatch(entry.name):
            with contextlib.suppress(OSError):
                if entry.stat().st_ino in inodes:
                    out.add(entry.name)
    return out


def group_segments(pgid: int) -> set[str]:
    """The ``/dev/shm`` segments of Python's multiprocessing that process group ``pgid``
    maps (a vLLM instance's message queues and semaphores, its ranks' shared memory: a
    SIGKILLed instance cannot unlink them)."""
    return _mapped_segments(group_members(pgid))


def proc_segments(proc: Any) -> set[str]:
    """``group_segments`` of ``proc``'s group, on whichever machine it runs."""
    return group_segments(proc.pid) if isinstance(proc, subprocess.Popen) else proc.segments()


def unlink_unmapped_of(proc: Any, names: set[str]) -> list[str]:
    """``unlink_unmapped`` on the machine ``proc`` runs on."""
    if isinstance(proc, subprocess.Popen):
        return unlink_unmapped(names)
    return list(proc.unlink_unmapped(names))


def unlink_unmapped(names: set[str]) -> list[str]:
    """Unlink those ``/dev/shm`` segments of ``names`` that no live process maps; which."""
    pids = [int(p.name) for p in Path("/proc").glob("[0-9]*")]
    gone = sorted(names - _mapped_segments(pids))
    for name in gone:
        Path("/dev/shm", name).unlink(missing_ok=True)
    return gone


def unlink_buffer(spec: NodeSpec) -> None:
    """Remove node ``spec``'s buffer segment if a side-car killed hard left it behind."""
    with contextlib.suppress(FileNotFoundError):
        shm = SharedMemory(spec.buffer_name)
        shm.close()
        shm.unlink()


@dataclass(slots=True)
class Launched:
    """The processes of one deployment, how to start each again, and where their logs are.

    ``start_*`` (re)start one process with its recorded command, after its group was killed
    (``kill``); once ``stop`` began, nothing starts any more (a restart racing a SIGTERM
    leaves no process behind)."""

    deployment: Deployment
    run_dir: Path
    log_dir: Path
    sidecar_commands: list[list[str]] = field(default_factory=list)
    instance_commands: list[list[str]] = field(default_factory=list)
    instance_envs: list[dict[str, str]] = field(default_factory=list)
    # the side-cars' environment (None: this process's), and the file holding the token every
    # side-car request carries (``token.py``; "" : none)
    sidecar_env: dict[str, str] | None = None
    token_file: str = ""
    sidecars: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # what the nodes use and outlive no run: a store server (started first, stopped last)
    service_commands: list[list[str]] = field(default_factory=list)
    services: list[subprocess.Popen[bytes]] = field(default_factory=list)
    instances: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)
    stopped: bool = False
    # Ray placement (``rayhost.RayPlacer``): each node's processes start on its machine;
    # None: all on this host
    placer: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_text(self, name: str, node: int | None = None) -> str:
        """Process ``name``'s log so far (the end of it when it is on another machine)."""
        if self.placer is not None and node is not None:
            return str(self.placer.read_text(node, str(self.log_path(name))))
        try:
            return self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""

    def _popen(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None,
        procs: list[Any],
        index: int,
        node: int | None = None,
    ) -> Any:
        """``node``: the node whose machine runs it (with a ``placer``); None: this host."""
        with self._lock:
            if self.stopped:
                raise RuntimeError(f"not starting {name}: the deployment is stopping")
            p: Any
            if self.placer is not None and node is not None:
                p = self.placer.start(node, name, cmd, env, str(self.log_path(name)))
            else:
                old = self.logs.pop(name, None)
                if old is not None:
                    old.close()
                log = self.logs[name] = self.log_path(name).open("ab")  # a restart appends
                p = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            if index < len(procs):
                procs[index] = p
            else:
                procs.append(p)
            self._write_pids()
        return p

    def start_sidecar(self, index: int) -> Any:
        """Start node ``index``'s side-car (it creates the node's buffer: one a dead side-car
        left behind is removed first)."""
        self._unlink_buffer(self.deployment.nodes[index])
        return self._popen(
            f"sidecar{index}",
            self.sidecar_commands[index],
            self.sidecar_env,
            self.sidecars,
            index,
            self.deployment.nodes[index].node,
        )

    def _unlink_buffer(self, spec: NodeSpec) -> None:
        if self.placer is not None:
            self.placer.unlink_buffer(spec)
        else:
            unlink_buffer(spec)

    def start_service(self, index: int) -> Any:
        return self._popen(
            f"service{index}", self.service_commands[index], None, self.services, index
        )

    def start_instance(self, index: int) -> Any:
        inst = self.deployment.instances[index]
        return self._popen(
            f"vllm{inst.node}-{inst.kind}",
            self.instance_commands[index],
            self.instance_envs[index],
            self.instances,
            index,
            inst.node,
        )

    def _write_pids(self) -> None:
        dep = self.deployment  # (during the launch, the later processes are not there yet)
        pids = {
            "sidecars": {s.node: p.pid for s, p in zip(dep.nodes, self.sidecars, strict=False)},
            "instances": {
                i.node: p.pid for i, p in zip(dep.instances, self.instances, strict=False)
            },
            "services": {i: p.pid for i, p in enumerate(self.services)},
            "urls": {i.node: i.url for i in dep.instances},
        }
        # Operators and tests read it while the launch goes on: a temp file, then a rename, so a
        # reader never sees it half written.
        final = self.log_dir / "processes.json"
        tmp = final.with_name(f".processes.json.{os.getpid()}")
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, final)

    def stop(self, grace_s: float = 10.0) -> None:
        """Instances first (SIGTERM to each group, then SIGKILL to whatever of it is left after
        ``grace_s``), then the side-cars; their buffers unlinked. No process is left: a step
        that fails (a node's machine that does not answer) is reported in one line and the
        others still run."""
        with self._lock:
            self.stopped = True
        try:
            # what they map now: gone with them, or left for us to unlink
            segments = [(p, _quietly(proc_segments, p) or set()) for p in self.instances]
            for group in (self.instances, self.sidecars, self.services):
                for p in group:
                    _quietly(kill_group, p, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                for p in group:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        _quietly(p.wait, timeout=max(0.1, deadline - time.monotonic()))
                for p in group:  # the leader is gone; its children may not be (EngineCore)
                    _quietly(kill_group, p, signal.SIGKILL)
            for spec in self.deployment.nodes:  # a side-car killed hard left its buffer
                _quietly(self._unlink_buffer, spec)
            for p, names in segments:
                _quietly(unlink_unmapped_of, p, names)
        finally:
            for f in self.logs.values():
                f.close()
            if self.placer is not None:
                _quietly(self.placer.close)
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; an OSError or RuntimeError (a remote node's) is one line on
    stderr and None. A timeout of ``wait`` passes through."""
    try:
        return fn(*args, **kwargs)
    except subprocess.TimeoutExpired:
        raise
    except (OSError, RuntimeError) as err:
        print(f"dualpath: stopping: {type(err).__name__}: {err}", file=sys.stderr)
        return None
