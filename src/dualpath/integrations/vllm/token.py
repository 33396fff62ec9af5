"""The shared secret of a deployment's side-cars: every control operation (slot leases, region
handles, reads, writes, pushes into a node's buffer) carries it, and a side-car started with
one refuses, with one line, any operation without it or with another.

Where it comes from, in every process (side-car, vLLM connector, router): the file named by
``$DUALPATH_SIDECAR_TOKEN_FILE`` (a Kubernetes Secret mounted read-only; ``serve --engine
vllm`` writes one per deployment, mode 0600), else ``$DUALPATH_SIDECAR_TOKEN`` itself. Neither:
no token (a side-car on one host's Unix sockets, tests of the protocol). The token is never
printed: not in logs, errors, ``describe`` or ``/metrics``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE_ENV = "DUALPATH_SIDECAR_TOKEN_FILE"
TOKEN_ENV = "DUALPATH_SIDECAR_TOKEN"
TOKEN_FIELD = "token"  # the field of each request line that carries it
REFUSAL = "unauthorized: missing or wrong side-car token (DUALPATH_SIDECAR_TOKEN_FILE)"

_cache: dict[tuple[str, str], str] = {}


def read_token_file(path: str) -> str:
    """The token in file ``path`` (surrounding whitespace dropped); ValueError (one line, the
    path and never the content) if it cannot be read or is empty."""
    try:
        text = Path(path).read_text().strip()
    except OSError as err:
        raise ValueError(f"{TOKEN_FILE_ENV}={path}: cannot read it ({err.strerror})") from None
    if not text:
        raise ValueError(f"{TOKEN_FILE_ENV}={path}: the file is empty")
    return text


def sidecar_token() -> str:
    """This process's token, from its environment ("" : none). Read once per setting."""
    path, value = os.environ.get(TOKEN_FILE_ENV, ""), os.environ.get(TOKEN_ENV, "")
    key = (path, value)
    if key not in _cache:
        _cache[key] = read_token_file(path) if path else value.strip()
    return _cache[key]


def write_token_file(path: Path, token: str) -> Path:
    """``token`` written to ``path``, a new file readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def new_token_file(path: Path) -> Path:
    """A fresh random token (256 bits) written to ``path``, readable by its owner only."""
    return write_token_file(path, secrets.token_hex(32))


def admits(expected: str, given: object) -> bool:
    """Whether a request carrying ``given`` passes a side-car expecting ``expected`` (""
    admits all); the comparison takes the same time wherever the strings differ."""
    if not expected:
        return True
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
