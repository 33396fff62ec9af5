"""A batched completion request (``prompt``: several strings or token lists) as vLLM answers it,
from one answer per prompt: the router runs each prompt through the DualPath flow on its own
and joins the answers here.

Pure: JSON and SSE bytes in, bytes out. vLLM numbers the choices of prompt ``i`` from ``i * n``
on, keeps one id for the whole batch and sums the usage; a stream interleaves the prompts'
events as they come and ends with one usage event (if asked for) and one ``[DONE]``.
"""

from __future__ import annotations

import json
import re
from typing import Any

_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')
_ID = re.compile(rb'^\{"id":"((?:[^"\\]|\\.)*)"')
_SUMMED = ("prompt_tokens", "completion_tokens", "total_tokens")


def batch_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a batched completion request (None: one prompt): a list of strings,
    or a list of token-id lists."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None  # token ids of one prompt (or invalid: the flow says which)


def add_usage(total: dict[str, Any], usage: Any) -> None:
    """``usage`` (one prompt's) added into ``total``."""
    if not isinstance(usage, dict):
        return
    for key in _SUMMED:
        total[key] = int(total.get(key, 0)) + int(usage.get(key) or 0)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and "cached_tokens" in details:
        mine = total.setdefault("prompt_tokens_details", {"cached_tokens": 0})
        mine["cached_tokens"] += int(details["cached_tokens"] or 0)


def join_whole(answers: list[bytes], n: int) -> bytes:
    """One answer per prompt (JSON, in prompt order) as vLLM's one answer to the batch."""
    joined: dict[str, Any] | None = None
    usage: dict[str, Any] = {}
    choices: list[Any] = []
    for i, raw in enumerate(answers):
        answer = json.loads(raw)
        if joined is None:
            joined = answer
        for choice in answer.get("choices") or []:
            choice["index"] = i * n + int(choice.get("index", 0))
            choices.append(choice)
        add_usage(usage, answer.get("usage"))
    assert joined is not None
    joined["choices"] = choices
    if joined.get("usage") is not None:
        joined["usage"] = usage
    return json.dumps(joined, ensure_ascii=False, separators=(",", ":")).encode()


class StreamJoin:
    """The events of several prompts' streams, as one batch's stream: each choice event's
    index moved to its place in the batch and its id made the batch's (the first seen); the
    per-prompt usage events and ``[DONE]`` held back until every stream ended (``close``)."""

    def __init__(self, n: int, include_usage: bool) -> None:
        self.n = n
        self.include_usage = include_usage
        self.batch_id: bytes | None = None
        self.usage: dict[str, Any] = {}
        self._last: dict[str, Any] | None = None  # a usage event's frame (id, object, …)

    def event(self, prompt: int, event: bytes) -> bytes:
        """One whole SSE event of prompt ``prompt``'s stream (no blank line): what to send."""
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return b""
        body = event[6:]
        m = _ID.match(body)
        if m:
            if self.batch_id is None:
                self.batch_id = m.group(1)
            body = b'{"id":"' + self.batch_id + b'"' + body[m.end() :]
        if b'"choices":[]' in body and b'"usage":{' in body:  # a prompt's closing usage
            payload = json.loads(body)
            add_usage(self.usage, payload.get("usage"))
            self._last = payload
            return b""
        idx = _INDEX.search(body)
        if idx:
            moved = prompt * self.n + int(idx.group(1))
            body = body[: idx.start(1)] + str(moved).encode() + body[idx.end(1) :]
        return b"data: " + body + b"\n\n"

    def close(self) -> bytes:
        """The batch's closing events: its summed usage (if asked for), then ``[DONE]``."""
        out = b""
        if self.include_usage and self._last is not None:
            payload = dict(self._last, usage=self.usage)
            text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
            out += b"data: " + text.encode() + b"\n\n"
        return out + b"data: [DONE]\n\n"
