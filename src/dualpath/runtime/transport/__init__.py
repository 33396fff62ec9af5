"""KV transports: the interface, a shared-memory, a TCP and a Mooncake Transfer Engine backend.

``DUALPATH_KV_HOST`` (default loopback) is the address the TCP and Mooncake backends serve
on; a multi-node launcher sets it per process to the node's address."""

from __future__ import annotations

import os

from dualpath.runtime.transport.base import KVTransport, RegionHandle, Transfer
from dualpath.runtime.transport.shm import ShmTransport

__all__ = ["KVTransport", "RegionHandle", "ShmTransport", "Transfer", "make_transport"]


KV_HOST_ENV = "DUALPATH_KV_HOST"


def make_transport(name: str) -> KVTransport:
    """``"shm"``, ``"tcp"`` or ``"mooncake"``; ValueError naming the allowed values otherwise."""
    host = os.environ.get(KV_HOST_ENV, "127.0.0.1")
    if name == "shm":
        return ShmTransport()
    if name == "tcp":
        from dualpath.runtime.transport.tcp import TcpTransport

        return TcpTransport(host)
    if name == "mooncake":
        from dualpath.runtime.transport.mooncake import MooncakeTransport

        return MooncakeTransport(host)
    raise ValueError(f"transport={name!r} is invalid: must be one of 'shm', 'tcp', 'mooncake'")
