"""Unit constants and helpers. Leaf module: imports nothing from dualpath."""

from __future__ import annotations

KB = 1_000
MB = 1_000_000
GB = 1_000_000_000
TB = 1_000_000_000_000
KiB = 1024
MiB = 1024**2
GiB = 1024**3
TFLOP = 1e12
PFLOP = 1e15


def gbit_to_bytes_per_s(gbit_per_s: float) -> float:
    """400 Gb/s → 50e9 bytes/s."""
    return gbit_per_s * 1e9 / 8


def parse_tokens(text: str | int) -> int:
    """'64k' → 65536, '32K' → 32768, '1000' → 1000 (binary K, as context lengths are)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower()
    mult = 1
    if s.endswith("k"):
        mult, s = 1024, s[:-1]
    elif s.endswith("m"):
        mult, s = 1024 * 1024, s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (expected e.g. 4096, 32k, 64K)") from None
    return int(value * mult)
