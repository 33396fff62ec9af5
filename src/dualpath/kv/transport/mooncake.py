"""Mooncake Transfer Engine backend: TCP transport here, RDMA with the same API on clusters.

Each process runs one ``TransferEngine`` with metadata server ``P2PHANDSHAKE`` (peers are
addressed by ``host:rpc_port``; no etcd). Regions are registered by address. The import needs
``mooncake-transfer-engine-non-cuda`` and the system library ``libibverbs1``.

Exposure: the library's RPC/handshake and TCP-transport listeners bind every interface
(``0.0.0.0`` and ``::``) whatever hostname ``initialize`` is given (``MC_TCP_BIND_ADDRESS`` made
no difference in our check), and they are unauthenticated. This backend therefore prints
``BIND_WARNING`` once at start-up; shared memory stays the default transport.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from dualpath.kv.transport.base import KVTransport, RegionHandle, Transfer, check_range

_PENDING, _DONE = 0, 1  # transfer_check_status: 0 pending, 1 completed, negative failed


BIND_WARNING = (
    "dualpath: warning: the Mooncake transport listens on all interfaces (0.0.0.0, ::), not "
    "only the configured host, without authentication; use --transport shm on shared hosts"
)

_LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def listening_sockets(pid: int | str = "self") -> list[tuple[str, str]]:
    """(protocol, local address as in /proc/net) of every TCP listener and UDP socket of
    process ``pid``."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(f"{fd_dir}/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes and (proto.startswith("udp") or f[3] == "0A"):  # 0A: LISTEN
                found.append((proto, f[1]))
    return found


def non_loopback(sockets: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(p, a) for p, a in sockets if a.rsplit(":", 1)[0] not in _LOOPBACK]


def load_engine_class() -> Any:
    """The ``TransferEngine`` class, or ImportError with the fix in its message."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        raise ImportError(
            "Mooncake transport unavailable: install 'mooncake-transfer-engine-non-cuda' "
            "(pip install 'dualpath[mooncake]') and the system library libibverbs1 "
            f"(apt-get install libibverbs1); import failed with: {err}"
        ) from err
    return TransferEngine


def address_of(memory: memoryview) -> int:
    """Base address of a writable buffer (mmap, shared memory, bytearray)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memory))


class _MooncakeTransfer(Transfer):
    def __init__(self, engine: Any, batch_id: int, poll_s: float) -> None:
        self._engine = engine
        self._batch_id = batch_id
        self._poll_s = poll_s
        self._state = _PENDING

    def done(self) -> bool:
        if self._state == _PENDING:
            self._state = int(self._engine.transfer_check_status(self._batch_id))
        if self._state < 0:
            raise RuntimeError(f"Mooncake transfer {self._batch_id} failed ({self._state})")
        return self._state != _PENDING

    def wait(self) -> None:
        while not self.done():
            time.sleep(self._poll_s)  # sleep, never spin: completion is polled


class MooncakeTransport(KVTransport):
    """One Transfer Engine per process; ``protocol`` "tcp" (here) or "rdma" (clusters)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", poll_s: float = 2e-4):
        engine_cls = load_engine_class()
        self._engine = engine_cls()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize failed with {rc}")
        self.endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self._poll_s = poll_s
        self._regions: dict[str, RegionHandle] = {}

    def register(self, name: str, memory: memoryview) -> RegionHandle:
        address = address_of(memory)
        rc = self._engine.register_memory(address, len(memory))
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({name!r}) failed with {rc}")
        handle = RegionHandle(self.endpoint, name, address, len(memory))
        self._regions[name] = handle
        return handle

    def _local(self, handle: RegionHandle) -> RegionHandle:
        if handle.endpoint != self.endpoint or handle.name not in self._regions:
            raise ValueError(f"region {handle.name!r} is not registered in this process")
        return handle

    def write(
        self, src: RegionHandle, src_offset: int, dst: RegionHandle, dst_offset: int, nbytes: int
    ) -> Transfer:
        self._local(src)
        check_range(src, src_offset, nbytes)
        check_range(dst, dst_offset, nbytes)
        bid = self._engine.transfer_submit_write(
            dst.endpoint, src.address + src_offset, dst.address + dst_offset, nbytes
        )
        return _MooncakeTransfer(self._engine, bid, self._poll_s)

    def write_many(
        self, src: RegionHandle, dst: RegionHandle, ranges: Sequence[tuple[int, int, int]]
    ) -> Transfer:
        self._local(src)
        for so, do, n in ranges:
            check_range(src, so, n)
            check_range(dst, do, n)
        bid = self._engine.batch_transfer_async_write(
            dst.endpoint,
            [src.address + so for so, _, _ in ranges],
            [dst.address + do for _, do, _ in ranges],
            [n for _, _, n in ranges],
        )
        if bid < 0:
            raise RuntimeError(f"Mooncake write to {dst.name!r} failed to submit ({bid})")
        return _MooncakeTransfer(self._engine, bid, self._poll_s)

    def read(
        self, dst: RegionHandle, dst_offset: int, src: RegionHandle, src_offset: int, nbytes: int
    ) -> Transfer:
        self._local(dst)
        check_range(src, src_offset, nbytes)
        check_range(dst, dst_offset, nbytes)
        # the batch API's asynchronous read (one entry): returns at once, like a write, so
        # the caller keeps a window of reads in flight
        bid = self._engine.batch_transfer_async_read(
            src.endpoint, [dst.address + dst_offset], [src.address + src_offset], [nbytes]
        )
        if bid < 0:
            raise RuntimeError(f"Mooncake read from {src.name!r} failed to submit ({bid})")
        return _MooncakeTransfer(self._engine, bid, self._poll_s)

    def close(self) -> None:
        for handle in self._regions.values():
            self._engine.unregister_memory(handle.address)
        self._regions.clear()
