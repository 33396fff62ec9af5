"""Helpers of the vLLM integration's tests: vLLM's Python (or a skip where the run allows
one), and two nodes of a deployment, a PE node 0 and a DE node 1, each with its side-car
process (its buffer, the store under ``root / "kv"``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dualpath.integrations.vllm.launch import find_vllm_python
from dualpath.integrations.vllm.node import NodeSpec, wait_ready
from dualpath.net import free_port


def vllm_python() -> str:
    """The Python that runs vLLM (``make test`` installs it): a missing vLLM fails the test,
    unless ``DUALPATH_SKIP_VLLM=1`` asks for a skip."""
    try:
        return find_vllm_python()
    except ValueError as err:
        if os.environ.get("DUALPATH_SKIP_VLLM") == "1":
            pytest.skip(f"DUALPATH_SKIP_VLLM=1: {err}")
        raise


@contextmanager
def running_sidecars(
    root: Path,
    num_slots: int,
    num_layers: int,
    block_tokens: int,
    row_bytes: int,
    namespace: str,
    networked: bool = False,
    token: str = "",
) -> Iterator[dict[int, NodeSpec]]:
    """The two nodes' specs while their side-cars serve; on exit both side-cars stopped
    cleanly (exit 0), their sockets and buffers gone. Sockets and locks live in a short
    temporary folder of their own: a Unix socket's path has at most 107 bytes.
    ``networked``: as nodes of a cluster, on TCP at 127.0.0.1, KV moved by Mooncake TE.
    ``token``: the side-cars' shared secret (their environment's; "": none)."""
    short = Path(tempfile.mkdtemp(prefix="dpn"))
    net = {
        n: {"host": "127.0.0.1", "control_port": free_port()} if networked else {} for n in (0, 1)
    }
    specs = {
        n: NodeSpec(
            n,
            kind,
            f"{short.name}n{n}",
            num_slots,
            str(short / f"{n}.lock"),
            str(short / f"{n}.sock"),
            str(root / "kv"),
            num_layers,
            block_tokens,
            row_bytes,
            namespace,
            **net[n],
        )
        for n, kind in ((0, "pe"), (1, "de"))
    }
    module = "dualpath.integrations.vllm.sidecar"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH_SIDECAR_TOKEN")}
    if token:
        env["DUALPATH_SIDECAR_TOKEN"] = token
    procs = [
        subprocess.Popen([sys.executable, "-m", module, s.to_json()], env=env)
        for s in specs.values()
    ]
    try:
        for s in specs.values():
            wait_ready(s.control, timeout_s=30, token=token)
        yield specs
    finally:
        for p in procs:
            p.terminate()
        codes = [p.wait(timeout=30) for p in procs]
        shutil.rmtree(short, ignore_errors=True)
    assert codes == [0, 0], f"side-cars exited with {codes}"
    assert not any(Path(s.socket_path).exists() for s in specs.values())
