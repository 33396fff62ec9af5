"""A node of a DualPath deployment over vLLM, as its clients see it: spec, buffer, requests.

``NodeSpec`` is what the launcher writes for each node (its buffer's name and geometry, the
lock and socket of its side-car, the store and the block layout); the vLLM workers of the node
attach its buffer by name (``attach_buffer``) and every process sends the side-car requests
(``call``: one JSON line each way, on its Unix socket, or over TCP on the node's CNIC address
when the node has one: nodes on separate machines, or network namespaces of one host, see
docs/deploy.md). The side-car itself is ``sidecar.py``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from typing import Any

from dualpath.integrations.vllm.token import TOKEN_FIELD, sidecar_token
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.doorbell import Doorbell
from dualpath.kv.pacer import LinkLock
from dualpath.kv.store import BlockLayout
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
    # A node of a cluster (its own machine or network namespace): its CNIC address, where its
    # side-car answers (``control_port``) and moves KV to other nodes (Mooncake TE); its SNIC
    # address, which its store client binds. "" : every node on one host (shared memory).
    host: str = ""
    control_port: int = 0
    snic_host: str = ""
    store_url: str = ""  # "" : the file store at kv_root; else ``kv.stores.open_store``'s
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype of the instances its blocks are for

    def __post_init__(self) -> None:
        if self.kind not in (EngineKind.PE.value, EngineKind.DE.value):
            raise ValueError(f"node {self.node}: kind={self.kind!r} is invalid: must be pe or de")
        if self.snic_bytes_per_s < 0:
            raise ValueError(
                f"node {self.node}: snic_bytes_per_s={self.snic_bytes_per_s} "
                "is invalid: must be >= 0"
            )
        if self.host and not 0 < self.control_port < 65536:
            raise ValueError(
                f"node {self.node}: control_port={self.control_port} is invalid: "
                "a node with a host address needs a TCP port"
            )

    @property
    def networked(self) -> bool:
        """Whether the node is reached over the network (its own machine or namespace)."""
        return bool(self.host)

    @property
    def control(self) -> str:
        """Where its side-car answers: ``tcp://HOST:PORT``, or its Unix socket's path."""
        return f"tcp://{self.host}:{self.control_port}" if self.host else self.socket_path

    @property
    def doorbell_path(self) -> str:
        """The buffer's doorbell (``kv.doorbell``: a FIFO beside its lock file, which the
        side-car makes): rung by every process that frees slots of it."""
        return self.lock_path + ".free"

    @property
    def store(self) -> str:
        """The store its side-car reads and writes (``kv.stores.open_store``'s URL)."""
        return self.store_url or self.kv_root

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
    buf.on_free = Doorbell(spec.doorbell_path).ring  # whoever waits for slots wakes
    return buf


class BufferOwners:
    """``plan.SlotOwners`` over the node buffers, for instance ``owner`` (its tag): claims a
    decode's leased slots, gives back a lease never claimed, pins a prefill's leased slots
    while it loads and saves them, allocates the slots its generated blocks are persisted
    from. Attaches each buffer at first use."""

    def __init__(self, nodes: dict[int, NodeSpec], owner: int) -> None:
        self.nodes = nodes
        self.owner = owner
        self._buffers: dict[int, SlotBuffer] = {}

    def buffer(self, node: int) -> SlotBuffer:
        buf = self._buffers.get(node)
        if buf is None:
            buf = self._buffers[node] = attach_buffer(self.nodes[node])
        return buf

    def alloc(self, node: int, n: int) -> list[int] | None:
        try:
            return self.buffer(node).alloc(n, owner=self.owner)
        except (OSError, KeyError, IndexError):  # no such node or buffer: nothing to give
            return None

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

    def pin(self, node: int, slots: Sequence[int], lease: int) -> bool:
        try:
            return self.buffer(node).pin(list(slots), lease, self.owner)
        except (OSError, KeyError, IndexError):  # no such node or buffer: nothing to pin
            return False

    def unpin(self, node: int, slots: Sequence[int]) -> int:
        try:
            return self.buffer(node).unpin(list(slots), self.owner)
        except (OSError, KeyError, IndexError):
            return 0

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


# A side-car's listening socket queues this many connections not yet accepted (Python's
# default, 5, refused most of a burst: 64 pings at once lost 41–46); the kernel caps it at
# net.core.somaxconn (4096 on current kernels)
LISTEN_BACKLOG = 1024
# A connect refused (nothing listens: a side-car restarting) or turned away (a Unix socket's
# queue full: EAGAIN) is tried again this many times, the wait doubling from CONNECT_BACKOFF_S
CONNECT_TRIES = 6
CONNECT_BACKOFF_S = 0.02
IDLE_PER_ADDRESS = 64  # connections a pool keeps open to one side-car, idle, at most
_RETRIED = (ConnectionRefusedError, BlockingIOError, InterruptedError)


def _connect_once(address: str, timeout_s: float) -> socket.socket:
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        return socket.create_connection((host, int(port)), timeout=timeout_s)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(address)
    except OSError:
        s.close()
        raise
    return s


def _connect(address: str, timeout_s: float) -> socket.socket:
    """A connection to a side-car at ``tcp://HOST:PORT`` or at a Unix socket's path; a refused
    or turned-away connect is tried again (``CONNECT_TRIES``, ~0.6 s in all)."""
    for attempt in range(CONNECT_TRIES):
        try:
            return _connect_once(address, timeout_s)
        except _RETRIED:
            if attempt == CONNECT_TRIES - 1:
                raise
            time.sleep(CONNECT_BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def _exchange(s: socket.socket, op: dict[str, Any], timeout_s: float, token: str) -> bytes:
    """One request line out (with ``token`` when there is one), one answer line back (b"" if
    the side-car closed first)."""
    s.settimeout(timeout_s)
    s.sendall(json.dumps({**op, TOKEN_FIELD: token} if token else op).encode() + b"\n")
    out = bytearray()
    while not out.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


def _answer(address: str, line: bytes) -> dict[str, Any]:
    if not line:
        raise OSError(f"side-car {address} closed the connection")
    answer: dict[str, Any] = json.loads(line)
    if "error" in answer:
        raise ValueError(f"side-car {address}: {answer['error']}")
    return answer


def call(
    address: str, op: dict[str, Any], timeout_s: float = 60.0, token: str | None = None
) -> dict[str, Any]:
    """One request to the side-car at ``address`` (``NodeSpec.control``) on a connection of
    its own, blocking; its answer, or OSError / ValueError. Many calls: ``SidecarPool``.
    ``token``: the side-cars' shared secret (None: this process's, ``token.sidecar_token``)."""
    secret = sidecar_token() if token is None else token
    with _connect(address, timeout_s) as s:
        return _answer(address, _exchange(s, op, timeout_s, secret))


class SidecarPool:
    """Side-car requests over kept-open connections (a pool per address, thread-safe): a burst
    of requests costs no connect each, and no listening queue fills up.

    ``call`` is ``call``'s signature. A kept connection that turns out closed by its side-car
    (it restarted: the send fails or the answer is an immediate end of stream) is replaced by
    a fresh one and the request sent once more; a request whose answer timed out is never
    resent (its connection is closed). A forked child starts with an empty pool. Every
    request carries ``token`` (None: this process's, ``token.sidecar_token``)."""

    def __init__(self, idle_per_address: int = IDLE_PER_ADDRESS, token: str | None = None) -> None:
        self.idle_per_address = idle_per_address
        self.token = sidecar_token() if token is None else token
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.num_connects = 0  # connections opened (tests: kept ones are reused)

    def _take(self, address: str) -> socket.socket | None:
        with self._lock:
            if self._pid != os.getpid():  # a fork: the parent's sockets are not ours
                self._idle, self._pid = {}, os.getpid()
            idle = self._idle.get(address)
            return idle.pop() if idle else None

    def _give(self, address: str, s: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.idle_per_address and self._pid == os.getpid():
                idle.append(s)
                return
        s.close()

    def _fresh(self, address: str, timeout_s: float) -> socket.socket:
        s = _connect(address, timeout_s)
        with self._lock:
            self.num_connects += 1
        return s

    def call(self, address: str, op: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
        s = self._take(address)
        if s is not None:
            try:
                line = _exchange(s, op, timeout_s, self.token)
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                line = b""
            except OSError:  # a timeout: the answer may still come, the connection is spent
                s.close()
                raise
            if line:
                self._give(address, s)
                return _answer(address, line)
            s.close()  # closed by the side-car while kept: send once more on a fresh one
        s = self._fresh(address, timeout_s)
        try:
            line = _exchange(s, op, timeout_s, self.token)
        except OSError:
            s.close()
            raise
        if line:
            self._give(address, s)
        else:
            s.close()
        return _answer(address, line)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for sockets in idle.values():
            for s in sockets:
                s.close()


def describe(address: str, timeout_s: float = 10.0) -> tuple[NodeSpec, dict[str, Any]]:
    """The spec of the node whose side-car is at ``address``, and the deployment's facts it
    was started with (``sidecar.NodeSidecar.facts``: weights digest, KV shape, engine)."""
    got = call(address, {"op": "describe"}, timeout_s)
    return NodeSpec(**got["spec"]), dict(got.get("facts") or {})


def wait_ready(address: str, timeout_s: float = 30.0, token: str | None = None) -> None:
    """Until the side-car at ``address`` answers a ping (TimeoutError after ``timeout_s``);
    ``token`` as ``call``'s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call(address, {"op": "ping"}, timeout_s=1.0, token=token)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"side-car {address} not ready after {timeout_s} s") from None
            time.sleep(0.05)


REMOTE_SLOTS_TIMEOUT_S = 5.0  # a side-car that does not answer a slot request within this


class RemoteSlots:
    """A node's buffer as a process on another node sees it: its slots allocated and given
    back by its side-car (``SlotBuffer``'s ``alloc`` / ``release`` / ``num_free``, one request
    each), its bytes moved only by the side-cars (``push``).

    ``alloc`` raises OSError / ValueError when the side-car cannot be asked (the caller fails
    the request cleanly); a give-back that cannot reach it frees nothing (0): a side-car that
    is gone took its buffer along, and its restart starts with every slot free."""

    def __init__(self, spec: NodeSpec, sidecar: Any = call) -> None:
        self.spec = spec.buffer
        self.node = spec
        self._sidecar = sidecar

    def _ask(self, op: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = self._sidecar(self.node.control, op, REMOTE_SLOTS_TIMEOUT_S)
        return answer

    def alloc(self, n: int, owner: int = 0, wait_s: float = 0.0) -> list[int] | None:
        """``n`` slots under ``owner``, or None; ``wait_s``: the side-car waits this long
        for slots to be freed before it answers None (woken by its buffer's doorbell)."""
        op: dict[str, Any] = {"op": "alloc", "num_slots": n, "owner": owner}
        if wait_s > 0:
            op["wait_s"] = wait_s
        slots = self._ask(op)["slots"]
        return None if slots is None else [int(s) for s in slots]

    def release(self, slots: list[int], owner: int) -> int:
        try:
            return int(
                self._ask({"op": "release", "slots": list(slots), "owner": owner})["released"]
            )
        except (OSError, ValueError):
            return 0

    def release_owner(self, owner: int) -> int:
        try:
            return int(self._ask({"op": "release_owner", "owner": owner})["released"])
        except (OSError, ValueError):
            return 0

    @property
    def num_free(self) -> int:
        """Free slots (0 while the side-car does not answer)."""
        try:
            return int(self._ask({"op": "stats"})["free_slots"])
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        """Nothing attached: nothing to close."""
