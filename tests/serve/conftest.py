"""Helpers for serve tests: a tiny HF checkpoint, a real `dualpath serve` on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProc:
    """``dualpath serve ARGS`` on a free loopback port; ``api_key``: what ``metric()`` sends
    (a server with ``--api-key`` keeps ``/metrics`` behind it); ``log``: its output goes to
    this file (a server that writes much must not block on a full pipe), else to a pipe."""

    api_key: str | None = None  # also for subclasses with their own __init__
    log: Path | None = None

    def __init__(
        self, args: list[str], api_key: str | None = None, log: Path | None = None
    ) -> None:
        self.port = free_port()
        self.args = args
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log = log
        cmd = [sys.executable, "-m", "dualpath.cli.main", "serve", "--port", str(self.port), *args]
        if log is None:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )
        else:
            with log.open("wb") as out:  # the server holds its own copy of the descriptor
                self.proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
                )
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.output()
                raise RuntimeError(f"server exited with {self.proc.returncode}: {out}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become ready")

    def output(self) -> str:
        """What the server wrote (all of it once it has exited)."""
        if self.log is not None:
            return self.log.read_text(errors="replace")
        return self.proc.stdout.read().decode() if self.proc.stdout else ""

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metric(self, name: str) -> float:
        import httpx

        total = 0.0
        response = httpx.get(self.url + "/metrics", headers=self.auth_headers)
        response.raise_for_status()
        for line in response.text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passed (False): a test waits
    for the state it checks (e.g. the runtime's next stats snapshot), not a guessed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


S = TypeVar("S", bound=ServerProc)


class ServerPool(Generic[S]):
    """A module's shared server, started again if a test stopped it: a test that stops the
    server may run in any order (the next test gets a fresh one; in file order nothing is
    started twice). ``close`` stops every server started, their exit codes."""

    def __init__(self, start: Callable[[], S]) -> None:
        self._start = start
        self.started: list[S] = []

    def live(self) -> S:
        if not self.started or self.started[-1].proc.poll() is not None:
            self.started.append(self._start())
        return self.started[-1]

    def close(self) -> list[int]:
        return [server.stop() for server in self.started]


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def hf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server on a checkpoint that `serve --init-tiny-checkpoint` writes itself (the same
    tiny Llama as ``hf_checkpoint``: seed 0)."""
    served = tmp_path_factory.mktemp("served")
    model_dir = served / "tiny-llama"
    server = ServerProc(
        [
            "--model-dir",
            str(model_dir),
            "--init-tiny-checkpoint",
            "--api-key",
            "acme=sk-test",
            "--block-tokens",
            "16",
            "--kv-root",
            str(served / "kv"),
        ],
        api_key="sk-test",
    )
    try:
        yield server
    finally:
        server.stop()
