"""KV transports: the interface, a shared-memory backend and a Mooncake Transfer Engine backend."""

from __future__ import annotations

from dualpath.runtime.transport.base import KVTransport, RegionHandle, Transfer
from dualpath.runtime.transport.shm import ShmTransport

__all__ = ["KVTransport", "RegionHandle", "ShmTransport", "Transfer", "make_transport"]


def make_transport(name: str) -> KVTransport:
    """``"shm"`` or ``"mooncake"``; ValueError naming the allowed values otherwise."""
    if name == "shm":
        return ShmTransport()
    if name == "mooncake":
        from dualpath.runtime.transport.mooncake import MooncakeTransport

        return MooncakeTransport()
    raise ValueError(f"transport={name!r} is invalid: must be one of 'shm', 'mooncake'")
