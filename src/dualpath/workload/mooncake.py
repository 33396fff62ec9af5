"""Loader for Mooncake-format request traces (FAST'25 release; design §9): JSONL lines of
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one per 512-token block).

Owns the prefix-trie hit rule and the session rule; reads a file, keeps no state between calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dualpath.config.checks import require

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake traces


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace request. ``hit_tokens`` is the prefix whose KV an earlier request stored."""

    timestamp_s: float
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    session_id: int

    def __post_init__(self) -> None:
        require(self.timestamp_s >= 0, "TraceRequest.timestamp_s", self.timestamp_s, ">= 0")
        require(self.prompt_tokens >= 1, "TraceRequest.prompt_tokens", self.prompt_tokens, ">= 1")
        require(
            0 <= self.hit_tokens < self.prompt_tokens,
            "TraceRequest.hit_tokens",
            self.hit_tokens,
            f"in [0, prompt_tokens={self.prompt_tokens})",
        )
        require(self.output_tokens >= 1, "TraceRequest.output_tokens", self.output_tokens, ">= 1")
        require(self.session_id >= 0, "TraceRequest.session_id", self.session_id, ">= 0")


class _Trie:
    """Prefix trie of hash-id chains: node 0 is the root; (parent, hash id) → child node."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.session_of: dict[
            int, int
        ] = {}  # node → session that created it as its last full block

    def matched(self, hash_ids: list[int]) -> list[int]:
        """Nodes of the longest prefix of ``hash_ids`` already in the trie."""
        path: list[int] = []
        node = 0
        for h in hash_ids:
            child = self.children.get((node, h))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(self, hash_ids: list[int], start: list[int]) -> list[int]:
        """Insert ``hash_ids`` whose first ``len(start)`` nodes are ``start``; return all nodes."""
        path = list(start)
        node = path[-1] if path else 0
        for h in hash_ids[len(start) :]:
            child = len(self.children) + 1
            self.children[(node, h)] = child
            path.append(child)
            node = child
        return path


def _field_int(row: dict[str, object], key: str, minimum: int, where: str) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}: '{key}'={value!r} is invalid: must be an integer >= {minimum}")
    return value


def _parse_line(line: str, where: str) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    stamp = row.get("timestamp")
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or not stamp >= 0:
        raise ValueError(f"{where}: 'timestamp'={stamp!r} is invalid: must be a number >= 0 (ms)")
    prompt = _field_int(row, "input_length", 1, where)
    output = _field_int(row, "output_length", 1, where)
    hash_ids = row.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    return float(stamp) / 1000.0, prompt, output, hash_ids


def load_mooncake(path: str | Path, block_tokens: int) -> list[TraceRequest]:
    """Requests of a Mooncake JSONL trace, in file order (blank lines skipped).

    Hits: block j of a request is a hit when the chain ``hash_ids[:j+1]`` appeared in an
    earlier line; hit_tokens = hit blocks × 512, capped at ``input_length - 1`` (the last
    prompt token is always computed) and rounded down to ``block_tokens``.
    Sessions: a request continues the session of the deepest matched node that an earlier
    request created as its own last full block (it extends that request's whole prompt);
    otherwise it opens a new session. Session ids count from 0 in order of first appearance.
    A bad line (bad JSON, a missing or invalid field, a timestamp earlier than the previous
    line's) raises ``ValueError`` naming the file and the line number.
    """
    require(block_tokens >= 1, "block_tokens", block_tokens, ">= 1")
    trie = _Trie()
    requests: list[TraceRequest] = []
    num_sessions = 0
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            stamp_s, prompt, output, hash_ids = _parse_line(line, where)
            if requests and stamp_s < requests[-1].timestamp_s:
                raise ValueError(f"{where}: 'timestamp' decreases: the trace must be in time order")
            matched = trie.matched(hash_ids)
            hit = min(len(matched) * TRACE_BLOCK_TOKENS, prompt - 1)
            hit = hit // block_tokens * block_tokens
            session = next(
                (trie.session_of[n] for n in reversed(matched) if n in trie.session_of), None
            )
            if session is None:
                session, num_sessions = num_sessions, num_sessions + 1
            nodes = trie.insert(hash_ids, matched)
            full_blocks = min(len(nodes), prompt // TRACE_BLOCK_TOKENS)
            if full_blocks > len(matched):  # its last full block is new: its session owns it
                trie.session_of[nodes[full_blocks - 1]] = session
            requests.append(TraceRequest(stamp_s, prompt, hit, output, session))
    return requests
