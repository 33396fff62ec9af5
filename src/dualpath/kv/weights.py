"""Which weights a KV cache belongs to: the digest of a checkpoint's files, the fingerprint of
the KV namespace (KV computed by other weights must never be a hit)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def checkpoint_digest(model_dir: str | Path) -> str:
    """blake2b over ``config.json`` and every ``*.safetensors`` shard's bytes (the KV
    namespace's fingerprint of the weights; ≈ 1 GB/s, once per run in the launcher)."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    for path in [root / "config.json", *sorted(root.glob("*.safetensors"))]:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
