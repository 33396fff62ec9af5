"""The one check of a ``--ray-address`` (Ray's GCS ``HOST:PORT``) that the runtime's Ray
launcher and the simulator's Ray studies share: a bad address is one line, before anything
starts."""

from __future__ import annotations

import socket

CONNECT_TIMEOUT_S = 5.0


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
