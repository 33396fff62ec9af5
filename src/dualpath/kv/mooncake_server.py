"""The Mooncake Store server ``--store mooncake`` runs: a master and one memory owner
(``StoreServer``), and ``python -m dualpath.kv.mooncake_server serve``. The client of the
blocks it holds is ``mooncake_store.MooncakeBlockStore``."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from dualpath.net import free_port

READY_TIMEOUT_S = 15.0  # master and owner each: until their port accepts
STOP_GRACE_S = 3.0  # SIGTERM to the group, then SIGKILL
EVICTION_HIGH_WATERMARK = 0.95  # a full store evicts old blocks (they become misses)


def find_binary(name: str) -> str:
    """The Mooncake binary ``name`` (the package's own, else on PATH); a one-line
    ``FileNotFoundError`` saying what to install otherwise."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"{name} not found: pip install mooncake-transfer-engine (or -non-cuda)"
        )
    return found


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise OSError(err.errno, f"port {port} on {host} is taken ({err.strerror})") from None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class StoreServer:
    """A Mooncake master plus one owner (``mooncake_client``) that contributes
    ``segment_bytes`` of memory, both in one process group (``stop`` signals the group, so
    none is left behind; each also gets SIGTERM if the starting thread dies)."""

    def __init__(self, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.host = ""
        self.port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.owner: subprocess.Popen[bytes] | None = None
        self.log_dir: str | None = None

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}"

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(
        self, host: str = "127.0.0.1", port: int = 50051, segment_bytes: int = 256 << 20
    ) -> StoreServer:
        """Start both and wait until each accepts connections; one-line ``OSError`` if a
        binary is missing or the port is taken, ``RuntimeError`` if one fails to come up."""
        if segment_bytes < 1 << 20:
            raise ValueError(f"segment_bytes={segment_bytes} is invalid: must be >= 1 MiB")
        master_bin, owner_bin = find_binary("mooncake_master"), find_binary("mooncake_client")
        check_port_free(host, port)
        self.host, self.port = host, port
        self.log_dir = tempfile.mkdtemp(prefix="dualpath-mooncake-")
        try:
            self.master = self._spawn(
                "master",
                [
                    master_bin,
                    f"--rpc_address={host}",
                    f"--rpc_port={port}",
                    f"--metrics_host={host}",  # its HTTP admin port cannot be turned off
                    f"--metrics_port={free_port(host)}",
                    "--enable_metric_reporting=false",
                    "--enable_ha=false",
                    f"--eviction_high_watermark_ratio={EVICTION_HIGH_WATERMARK}",
                ],
                os.environ,
                0,
            )
            self._wait_ready(self.master, "master", port)
            owner_port = free_port(host)
            # the owner advertises MC_TCP_BIND_ADDRESS to readers: unset, other nodes' GETs
            # go to an address they cannot reach and fail with -800
            env = {**os.environ, "MC_TCP_BIND_ADDRESS": host}
            self.owner = self._spawn(
                "owner",
                [
                    owner_bin,
                    f"--host={host}",
                    f"--port={owner_port}",
                    f"--master_server_address={host}:{port}",
                    "--metadata_server=P2PHANDSHAKE",
                    f"--global_segment_size={segment_bytes}",
                    "--local_buffer_size=0",
                    "--protocol=tcp",
                ],
                env,
                self.master.pid,
            )
            self._wait_ready(self.owner, "owner", owner_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str], env: Any, group: int) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        with open(os.path.join(self.log_dir, f"{name}.log"), "wb") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=group,
                preexec_fn=_die_with_parent,
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes], name: str, port: int) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake {name} exited with {proc.returncode}: {self._last_line(name)}"
                )
            try:
                socket.create_connection((self.host, port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"mooncake {name} not ready on port {port} after {self.ready_timeout_s} s: "
            f"{self._last_line(name)}"
        )

    def _last_line(self, name: str) -> str:
        if self.log_dir is None:
            return ""
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as log:
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        errors = [line for line in lines if line.startswith(("E", "F"))]
        return (errors or lines or [""])[-1]

    def kill_owner(self) -> None:
        """Fault injection: the owner dies (SIGKILL); its memory, and every block in it, is
        gone."""
        if self.owner is not None:
            self.owner.kill()
            self.owner.wait()

    def kill_master(self) -> None:
        """Fault injection: the master dies (SIGKILL)."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()

    def is_alive(self) -> bool:
        procs = (self.master, self.owner)
        return all(p is not None and p.poll() is None for p in procs)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after ``STOP_GRACE_S``; remove the logs."""
        procs = [p for p in (self.owner, self.master) if p is not None]
        if procs:
            group = procs[-1].pid  # the master's pid: the group's id
            _signal_group(group, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
            _signal_group(group, signal.SIGKILL)  # a straggler (or a child it forked)
            for proc in procs:
                proc.wait()
        self.master = self.owner = None
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(group, sig)


def serve(host: str, port: int, segment_mib: int) -> int:
    """Run a ``StoreServer`` until SIGTERM / SIGINT (0), or until a process of it dies (1)."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    with StoreServer().start(host, port, segment_mib << 20) as server:
        print(f"mooncake store serving at {server.url}", flush=True)
        while not stopping.wait(0.5):
            if not server.is_alive():
                print(f"mooncake store at {server.url}: a process died", file=sys.stderr)
                return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dualpath.kv.mooncake_server")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run a master and one memory owner until SIGTERM")
    run.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    run.add_argument("--port", type=int, default=50051, help="the master's RPC port")
    run.add_argument("--segment-mib", type=int, default=1024, help="memory the owner gives")
    args = parser.parse_args(argv)
    try:
        return serve(args.host, args.port, args.segment_mib)
    except (OSError, RuntimeError, ValueError) as err:
        print(f"dualpath: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
