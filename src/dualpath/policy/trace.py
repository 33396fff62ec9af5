"""The decision trace: one JSON-safe dict per scheduling decision, and JSONL helpers.

The policy only appends records; writing them out is the caller's choice (``write_jsonl``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]

# Record kinds, in the order a request meets them.
KINDS = ("pe", "pe_wait", "de_group", "de", "de_wait", "side")


class DecisionTrace:
    """An append-only list of decision records (a no-op unless ``enabled``)."""

    __slots__ = ("enabled", "records")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.records: list[Record] = []

    def add(self, kind: str, now: float, **fields: Any) -> None:
        record: Record = {"kind": kind, "now": now}
        record.update(fields)
        self.records.append(record)


def explain(records: Sequence[Record], request_id: int) -> list[Record]:
    """Every record about ``request_id``, in decision order ("why did r go to DE 5?")."""
    return [r for r in records if r.get("request") == request_id]


def to_jsonl(records: Iterable[Record]) -> str:
    """One JSON object per line, keys sorted (stable across runs)."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def write_jsonl(records: Iterable[Record], path: str | Path) -> int:
    """Write ``records`` to ``path`` as JSONL; returns the number written."""
    items = list(records)
    p = Path(path)
    try:
        p.write_text(to_jsonl(items))
    except OSError as exc:
        raise ValueError(f"decision trace {str(p)!r} cannot be written: {exc.strerror}") from None
    return len(items)


def read_jsonl(path: str | Path) -> list[Record]:
    """Load a trace written by ``write_jsonl``."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"decision trace {str(p)!r} cannot be read: {exc.strerror}") from None
    return [json.loads(line) for line in lines if line.strip()]
