"""Same-host transport: regions are shared-memory segments, a transfer is a memcpy.

Copies run on one worker thread (numpy copies release the GIL), so callers overlap them
with compute exactly as with a NIC. Regions are attached lazily by name.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from dualpath.kv.transport.base import (
    FutureTransfer,
    KVTransport,
    RegionHandle,
    Transfer,
    check_range,
)


class ShmTransport(KVTransport):
    """Local regions are any memoryview; peer regions must be shared-memory segments."""

    def __init__(self) -> None:
        self._local: dict[str, memoryview] = {}
        self._peers: dict[str, SharedMemory] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-transport")
        self.endpoint = f"shm:{os.getpid()}"

    def register(self, name: str, memory: memoryview) -> RegionHandle:
        self._local[name] = memory
        return RegionHandle(self.endpoint, name, 0, len(memory))

    def _view(self, handle: RegionHandle) -> np.ndarray:
        if handle.name in self._local:
            return np.frombuffer(self._local[handle.name], dtype=np.uint8)
        shm = self._peers.get(handle.name)
        if shm is None:
            shm = SharedMemory(name=handle.name)
            self._peers[handle.name] = shm
        assert shm.buf is not None
        return np.frombuffer(shm.buf, dtype=np.uint8)

    def _copy(
        self, dst: RegionHandle, dst_offset: int, src: RegionHandle, src_offset: int, n: int
    ) -> Transfer:
        check_range(src, src_offset, n)
        check_range(dst, dst_offset, n)
        d = self._view(dst)[dst_offset : dst_offset + n]
        s = self._view(src)[src_offset : src_offset + n]
        return FutureTransfer(self._pool.submit(np.copyto, d, s))

    def write(
        self, src: RegionHandle, src_offset: int, dst: RegionHandle, dst_offset: int, nbytes: int
    ) -> Transfer:
        return self._copy(dst, dst_offset, src, src_offset, nbytes)

    def read(
        self, dst: RegionHandle, dst_offset: int, src: RegionHandle, src_offset: int, nbytes: int
    ) -> Transfer:
        return self._copy(dst, dst_offset, src, src_offset, nbytes)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for shm in self._peers.values():
            shm.close()
        self._peers.clear()
        self._local.clear()
