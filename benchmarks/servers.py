"""Servers for the serving benchmarks (bench_latency, bench_peer): `dualpath serve` and plain vLLM
on 127.0.0.1, each a process group started, waited for (seconds to ready) and stopped
(seconds to exit after SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from dualpath.frontend.checkpoint import write_tiny_checkpoint
from dualpath.net import free_port


def tiny_llama(folder: Path) -> Path:
    """The benchmarks' checkpoint: a tiny random Llama (4 layers, hidden 256, head_dim 64)."""
    return write_tiny_checkpoint(
        folder / "llama-4l-256",
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=688,
    )


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    ready_s: float = 0.0
    stop_s: float = 0.0

    def wait(self, timeout_s: float = 400) -> Server:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url}: exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.ready_s = time.monotonic() - start
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.url}: not ready after {timeout_s} s")

    def stop(self, grace_s: float = 60) -> None:
        if self.proc.poll() is not None:
            return
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stop_s = time.monotonic() - start

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    cmd = [*cmd, "--port", str(port)]
    with log.open("wb") as f:  # (the child keeps its own descriptor)
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(proc, f"http://127.0.0.1:{port}").wait()


def dualpath_serve(
    ckpt: Path, kv_root: Path, log: Path, args: list[str], env: dict[str, str] | None = None
) -> Server:
    """`dualpath serve` (our engine) on ``ckpt`` with a fresh store at ``kv_root``."""
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli.main",
        "serve",
        "--model-dir",
        str(ckpt),
        "--kv-root",
        str(kv_root),
        *args,
    ]
    return _start(cmd, log, {**os.environ, **(env or {})})


def vllm_python() -> str | None:
    """The Python of the vLLM install (None: vLLM is not installed)."""
    from dualpath.integrations.vllm.launch import find_vllm_python

    try:
        return find_vllm_python()
    except (RuntimeError, ValueError, OSError):
        return None


def plain_vllm(ckpt: Path, log: Path, dtype: str = "float32", kv_gib: int = 1) -> Server:
    """One plain vLLM OpenAI server (its own prefix cache, no connector) on ``ckpt``."""
    python = vllm_python()
    if python is None:
        raise RuntimeError("vLLM is not installed (make vllm)")
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--served-model-name",
        ckpt.name,
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--block-size",
        "32",
        "--max-model-len",
        "4096",
    ]
    return _start(cmd, log, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)})
