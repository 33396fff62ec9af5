"""KV transports: the interface, a shared-memory, a TCP and a Mooncake Transfer Engine backend.

``DUALPATH_KV_HOST`` (default loopback) is the address the TCP and Mooncake backends serve
on; a multi-node launcher sets it per process to the node's address. ``DUALPATH_KV_DSCP``
(0..63) marks the TCP backend's packets for the fabric's low (KV) lane;
``DUALPATH_KV_PROTOCOL`` is Mooncake's protocol (``tcp``, default, or ``rdma``)."""

from __future__ import annotations

import os

from dualpath.runtime.transport.base import KVTransport, RegionHandle, Transfer
from dualpath.runtime.transport.shm import ShmTransport

__all__ = ["KVTransport", "RegionHandle", "ShmTransport", "Transfer", "make_transport"]


KV_HOST_ENV = "DUALPATH_KV_HOST"
KV_DSCP_ENV = "DUALPATH_KV_DSCP"
KV_PROTOCOL_ENV = "DUALPATH_KV_PROTOCOL"


def _dscp_from_env() -> int:
    text = os.environ.get(KV_DSCP_ENV, "")
    if not text:
        return -1
    if not text.isdigit() or int(text) > 63:
        raise ValueError(f"{KV_DSCP_ENV}={text!r} is invalid: must be a DSCP value in 0..63")
    return int(text)


def make_transport(name: str) -> KVTransport:
    """``"shm"``, ``"tcp"`` or ``"mooncake"``; ValueError naming the allowed values otherwise."""
    host = os.environ.get(KV_HOST_ENV, "127.0.0.1")
    if name == "shm":
        return ShmTransport()
    if name == "tcp":
        from dualpath.runtime.transport.tcp import TcpTransport

        return TcpTransport(host, dscp=_dscp_from_env())
    if name == "mooncake":
        from dualpath.runtime.transport.mooncake import MooncakeTransport

        protocol = os.environ.get(KV_PROTOCOL_ENV, "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"{KV_PROTOCOL_ENV}={protocol!r} is invalid: must be 'tcp' or 'rdma'")
        return MooncakeTransport(host, protocol)
    raise ValueError(f"transport={name!r} is invalid: must be one of 'shm', 'tcp', 'mooncake'")
