"""A node of a DualPath deployment over vLLM, as its clients see it: spec, buffer, requests.

``NodeSpec`` is what the launcher writes for each node (its buffer's name and geometry, the
lock and socket of its side-car, the store and the block layout); the router and the vLLM
workers attach the node's buffer by name (``attach_buffer``) and send the side-car requests
(``call``: one JSON line each way on its Unix socket). The side-car itself is ``sidecar.py``.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from typing import Any

from dualpath.runtime.buffer import BufferSpec, SlotBuffer
from dualpath.runtime.kvstore import BlockLayout
from dualpath.runtime.pacer import LinkLock
from dualpath.types import EngineKind


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Everything a node's side-car and its clients need, as JSON (the launcher writes it)."""

    node: int
    kind: str  # "pe" or "de"
    buffer_name: str
    num_slots: int
    lock_path: str
    socket_path: str
    kv_root: str
    num_layers: int
    block_tokens: int
    row_bytes: int  # KV bytes of one token in one layer
    store_namespace: str  # the tenant-free namespace every block header carries
    snic_bytes_per_s: float = 0.0  # 0: unpaced

    def __post_init__(self) -> None:
        if self.kind not in (EngineKind.PE.value, EngineKind.DE.value):
            raise ValueError(f"node {self.node}: kind={self.kind!r} is invalid: must be pe or de")
        if self.snic_bytes_per_s < 0:
            raise ValueError(f"node {self.node}: snic_bytes_per_s={self.snic_bytes_per_s} "
                             "is invalid: must be >= 0")  # fmt: skip

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout(self.num_layers, self.block_tokens, self.row_bytes)

    @property
    def buffer(self) -> BufferSpec:
        return BufferSpec(self.buffer_name, self.num_slots, self.layout.full_block_bytes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        return cls(**json.loads(text))


def instance_owner(node: int) -> int:
    """The owner tag (``SlotBuffer``) of the slots node ``node``'s vLLM instance holds: its
    scheduler claims a decode's leased slots under it, its workers allocate under it; when
    the instance dies, what it held is freed by this tag. Router leases are > 0."""
    return -(node + 1)


def attach_buffer(spec: NodeSpec) -> SlotBuffer:
    """Attach to node ``spec``'s buffer from any process of the host. The segment is the
    side-car's: it is taken off this process's resource tracker, which would otherwise unlink
    it (under every other process) when this one exits."""
    buf = SlotBuffer.attach(spec.buffer, LinkLock(spec.lock_path))
    resource_tracker.unregister("/" + spec.buffer_name, "shared_memory")
    return buf


class BufferOwners:
    """``plan.SlotOwners`` over the node buffers, for instance ``owner`` (its tag): claims a
    decode's leased slots, gives back a lease never claimed. Attaches each buffer at first use."""

    def __init__(self, nodes: dict[int, NodeSpec], owner: int) -> None:
        self.nodes = nodes
        self.owner = owner
        self._buffers: dict[int, SlotBuffer] = {}

    def buffer(self, node: int) -> SlotBuffer:
        buf = self._buffers.get(node)
        if buf is None:
            buf = self._buffers[node] = attach_buffer(self.nodes[node])
        return buf

    def claim(self, node: int, slots: Sequence[int], lease: int) -> bool:
        try:
            return self.buffer(node).transfer(list(slots), lease, self.owner)
        except (OSError, KeyError, IndexError):  # no such node or buffer: a lost load
            return False

    def release(self, node: int, slots: Sequence[int], lease: int) -> int:
        try:
            return self.buffer(node).release(list(slots), lease)
        except (OSError, KeyError, IndexError):
            return 0

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


def call(socket_path: str, op: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """One request to a side-car (blocking); its answer, or OSError / ValueError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(socket_path)
        s.sendall(json.dumps(op).encode() + b"\n")
        line = s.makefile("rb").readline()
    if not line:
        raise OSError(f"side-car {socket_path} closed the connection")
    answer: dict[str, Any] = json.loads(line)
    if "error" in answer:
        raise ValueError(f"side-car {socket_path}: {answer['error']}")
    return answer


def wait_ready(socket_path: str, timeout_s: float = 30.0) -> None:
    """Until the side-car at ``socket_path`` answers a ping (TimeoutError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call(socket_path, {"op": "ping"}, timeout_s=1.0)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"side-car {socket_path} not ready after {timeout_s} s"
                ) from None
            time.sleep(0.05)
