"""Tests of the KV machinery every shell shares (``src/dualpath/kv``). They need none of the
runtime extra, except the transports' (numpy), which are not collected without it;
``test_torch_free.py`` checks statically what importing each of them runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

NEED_NUMPY = ("test_transport.py", "test_tcp_transport.py")


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if collection_path.name in NEED_NUMPY and importlib.util.find_spec("numpy") is None:
        return True
    return None
