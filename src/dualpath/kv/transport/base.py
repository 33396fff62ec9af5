"""The KV transfer interface: registered memory regions and one-sided async writes/reads.

KV payloads move only through a transport; control messages carry ``RegionHandle``s and
offsets, never bytes. Backends: shared memory (same host) and Mooncake Transfer Engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RegionHandle:
    """A registered region as peers see it (picklable; travels in control messages).

    ``endpoint``: the owner's transport address; ``address``: the region's base in the owner's
    address space (0 where the backend addresses regions by name)."""

    endpoint: str
    name: str
    address: int
    size_bytes: int


class Transfer(ABC):
    """An in-flight transfer; ``wait`` blocks until done and raises on failure."""

    @abstractmethod
    def wait(self) -> None: ...

    @abstractmethod
    def done(self) -> bool: ...


class FutureTransfer(Transfer):
    """A transfer run by a thread pool (the shm and TCP transports)."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def done(self) -> bool:
        return self._future.done()


class AllOf(Transfer):
    """Several transfers as one: done when each is, failed when one failed."""

    def __init__(self, parts: list[Transfer]) -> None:
        self._parts = parts

    def wait(self) -> None:
        for part in self._parts:
            part.wait()

    def done(self) -> bool:
        return all(part.done() for part in self._parts)


class KVTransport(ABC):
    """Moves bytes between a local registered region and a peer's registered region."""

    @abstractmethod
    def register(self, name: str, memory: memoryview) -> RegionHandle:
        """Register local ``memory`` (must stay alive) under ``name``; peers get the handle."""

    @abstractmethod
    def write(
        self, src: RegionHandle, src_offset: int, dst: RegionHandle, dst_offset: int, nbytes: int
    ) -> Transfer:
        """Copy ``nbytes`` from local region ``src`` to peer region ``dst`` (async)."""

    def write_many(
        self, src: RegionHandle, dst: RegionHandle, ranges: Sequence[tuple[int, int, int]]
    ) -> Transfer:
        """Copy each ``(src_offset, dst_offset, nbytes)`` of ``ranges`` from local region
        ``src`` to peer region ``dst`` (async), as one transfer (a backend with a batch API
        submits them at once)."""
        return AllOf([self.write(src, so, dst, do, n) for so, do, n in ranges])

    @abstractmethod
    def read(
        self, dst: RegionHandle, dst_offset: int, src: RegionHandle, src_offset: int, nbytes: int
    ) -> Transfer:
        """Copy ``nbytes`` from peer region ``src`` into local region ``dst`` (async)."""

    @abstractmethod
    def close(self) -> None: ...


def check_range(handle: RegionHandle, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > handle.size_bytes:
        raise ValueError(
            f"range [{offset}, {offset + nbytes}) is invalid for region {handle.name!r} "
            f"of {handle.size_bytes} bytes"
        )
