"""Which block store a URL names (``open_store``): the file store or Mooncake Store.

Shared by the runtime and the vLLM integration; owns no store logic itself.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from dualpath.kv.store import BlockLayout, BlockStore, KVStore

URL_FORMS = "a path, file://PATH or mooncake://MASTER_HOST:PORT"


def open_store(
    url: str,
    layout: BlockLayout,
    namespace: str = "",
    local_hostname: str = "127.0.0.1",
    timeout_s: float | None = None,
) -> BlockStore:
    """The store ``url`` names: a plain path or ``file://PATH`` → ``KVStore``;
    ``mooncake://MASTER_HOST:PORT`` → ``MooncakeBlockStore`` (connected: a pure client whose
    transfer engine binds ``local_hostname``, the node's SNIC address in a cluster).
    A bad URL is a one-line ``ValueError`` naming it."""
    if "://" not in url:
        if not url:
            raise ValueError(f"store url {url!r} is invalid: must be {URL_FORMS}")
        return KVStore(Path(url), layout, namespace=namespace)
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = parts.netloc + parts.path
        if not path or parts.query or parts.fragment:
            raise ValueError(f"store url {url!r} is invalid: must be {URL_FORMS}")
        return KVStore(Path(path), layout, namespace=namespace)
    if parts.scheme == "mooncake":
        try:
            host, port = parts.hostname, parts.port
        except ValueError:  # a port that is not a number
            host = port = None
        if not host or not port or parts.path not in ("", "/") or parts.query:
            raise ValueError(f"store url {url!r} is invalid: must be {URL_FORMS}")
        from dualpath.kv.mooncake_store import MooncakeBlockStore

        master = f"{host}:{port}"
        if timeout_s is None:
            return MooncakeBlockStore.connect(master, layout, namespace, local_hostname)
        return MooncakeBlockStore.connect(
            master, layout, namespace, local_hostname, timeout_s=timeout_s
        )
    raise ValueError(f"store url {url!r} is invalid: must be {URL_FORMS}")
