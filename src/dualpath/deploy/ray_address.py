"""What every user of a Ray cluster here shares (the runtime's Ray launcher, the vLLM
deployment's placement, the simulator's Ray studies): the one check of a ``--ray-address``
(Ray's GCS ``HOST:PORT``; a bad address is one line, before anything starts), the custom
resource that marks emulated node ``n``'s Ray node, and Ray itself or a one-line error."""

from __future__ import annotations

import socket
from typing import Any

CONNECT_TIMEOUT_S = 5.0
# node n's Ray node offers this resource (``ray start --resources '{"dualpath_node3": 1}'``)
RESOURCE_PREFIX = "dualpath_node"


def node_resource(node: int) -> str:
    return f"{RESOURCE_PREFIX}{node}"


def require_ray() -> Any:
    """The ``ray`` module, or ValueError (one line) naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--runtime ray needs Ray, which is not installed: pip install 'dualpath[ray]'"
        ) from None
    return ray


def check_gcs_address(address: str, local_ok: bool = False) -> None:
    """ValueError (one line) unless ``address`` is a ``HOST:PORT`` that accepts a TCP
    connection (a Ray GCS), or ``local`` where ``local_ok`` (a new Ray instance here)."""
    if local_ok and address == "local":
        return
    expected = "'local' or the head's GCS address HOST:PORT" if local_ok else "HOST:PORT"
    if "://" in address:
        raise ValueError(
            f"--ray-address {address!r} is invalid: give {expected} "
            "(Ray Client ray:// addresses are not supported)"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r} is invalid: expected {expected}")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ValueError(
            f"--ray-address {address!r} is unreachable: {err.strerror or err} "
            "(is `ray start --head` running there?)"
        ) from None
