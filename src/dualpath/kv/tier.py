"""A node's DRAM tier in front of storage (the ``dram-tier`` system, docs/peers.md): whole
Full Blocks by key, least recently used first, within a byte capacity. Thread-safe (a
storage worker's reader and writer threads share it). Holds copies: a block leaves the node
buffer's slot it came from, the tier keeps its own bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict


class DramTier:
    """``capacity_bytes`` of blocks; ``hits`` / ``misses`` count ``get``; ``evicted`` the
    blocks pushed out for room."""

    def __init__(self, capacity_bytes: float) -> None:
        if not capacity_bytes >= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} is invalid: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.hits = self.misses = self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Keep a copy of block ``key`` (most recently used); one larger than the whole tier
        is not kept."""
        block = bytes(data)
        if len(block) > self.capacity_bytes:
            return
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            self._blocks[key] = block
            self.used_bytes += len(block)
            while self.used_bytes > self.capacity_bytes:
                _, out = self._blocks.popitem(last=False)
                self.used_bytes -= len(out)
                self.evicted += 1

    def get(self, key: str, out: memoryview) -> bool:
        """Copy block ``key`` into ``out`` (marks it used); False if the tier lacks it."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return False
            self._blocks.move_to_end(key)
            self.hits += 1
        out[: len(block)] = block
        return True
