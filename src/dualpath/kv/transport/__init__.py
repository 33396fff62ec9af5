"""KV transports: the interface, a shared-memory, a TCP and a Mooncake Transfer Engine backend.

``DUALPATH_KV_HOST`` (default loopback) is the address the TCP and Mooncake backends serve
on; a multi-node launcher sets it per process to the node's address. ``DUALPATH_KV_DSCP``
(0..63) marks the TCP backend's packets for the fabric's low (KV) lane;
``DUALPATH_KV_PROTOCOL`` is Mooncake's protocol (``tcp``, default, or ``rdma``).

Collectives (the PEs' hidden-state exchange) get a transport of their own across nodes, a TCP
one whose packets carry the traffic manager's high-class DSCP (``DUALPATH_COLLECTIVE_DSCP``,
default 26 as ``dualpath qos`` configures), so that a NIC's arbiter can tell them from KV.
Mooncake's TCP transport cannot mark its sockets (over RDMA it takes ``MC_IB_TC``)."""

from __future__ import annotations

import os

from dualpath.kv.transport.base import KVTransport, RegionHandle, Transfer
from dualpath.kv.transport.shm import ShmTransport

__all__ = [
    "KVTransport",
    "RegionHandle",
    "ShmTransport",
    "Transfer",
    "make_collective_transport",
    "make_transport",
]


KV_HOST_ENV = "DUALPATH_KV_HOST"
KV_DSCP_ENV = "DUALPATH_KV_DSCP"
KV_PROTOCOL_ENV = "DUALPATH_KV_PROTOCOL"
COLLECTIVE_DSCP_ENV = "DUALPATH_COLLECTIVE_DSCP"


def _dscp_from_env(var: str = KV_DSCP_ENV, default: int = -1) -> int:
    text = os.environ.get(var, "")
    if not text:
        return default
    if not text.isdigit() or int(text) > 63:
        raise ValueError(f"{var}={text!r} is invalid: must be a DSCP value in 0..63")
    return int(text)


def make_collective_transport(name: str) -> KVTransport | None:
    """The collectives' own marked TCP transport where the KV transport ``name`` crosses
    nodes; None for ``"shm"`` (one host, no NIC: the KV transport serves)."""
    if name == "shm":
        return None
    from dualpath.deploy.qos import COLLECTIVE_DSCP
    from dualpath.kv.transport.tcp import TcpTransport

    host = os.environ.get(KV_HOST_ENV, "127.0.0.1")
    return TcpTransport(host, dscp=_dscp_from_env(COLLECTIVE_DSCP_ENV, COLLECTIVE_DSCP))


def make_transport(name: str) -> KVTransport:
    """``"shm"``, ``"tcp"`` or ``"mooncake"``; ValueError naming the allowed values otherwise."""
    host = os.environ.get(KV_HOST_ENV, "127.0.0.1")
    if name == "shm":
        return ShmTransport()
    if name == "tcp":
        from dualpath.kv.transport.tcp import TcpTransport

        return TcpTransport(host, dscp=_dscp_from_env())
    if name == "mooncake":
        from dualpath.kv.transport.mooncake import MooncakeTransport

        protocol = os.environ.get(KV_PROTOCOL_ENV, "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"{KV_PROTOCOL_ENV}={protocol!r} is invalid: must be 'tcp' or 'rdma'")
        return MooncakeTransport(host, protocol)
    raise ValueError(f"transport={name!r} is invalid: must be one of 'shm', 'tcp', 'mooncake'")
