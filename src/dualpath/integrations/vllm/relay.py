"""The decode instance's answer on its way to the client, as vLLM wrote it but for one field:
``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens the store served (vLLM would
count the whole buffer load: prompt − 1 on every turn, a cold one included).

Pure: bytes in, bytes out. ``EventRelay`` cuts an SSE byte stream into whole events, each
passed on as vLLM wrote it (only a usage object is parsed, cut out or written again), counts
the tokens they bring (from each event's usage: exact when vLLM merged steps) and says when
``[DONE]`` passed.
"""

from __future__ import annotations

import json
import re
from typing import Any

_USAGE = (b'"usage":{', b'"usage": {')  # how a JSON usage object starts (never inside a string)
_CHOICE = (b'"choices":[{', b'"choices": [{')  # an event with a choice: a step's new tokens
_OPENING = b'"delta":{"role":"assistant","content":""}'  # a chat stream's first event: no token


def set_cached_tokens(payload: Any, cached_tokens: int) -> bool:
    """Put ``cached_tokens`` into ``payload``'s usage (a chat or text completion or a chunk of
    one); whether it had a usage object."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {
        **(details if isinstance(details, dict) else {}),
        "cached_tokens": cached_tokens,
    }
    return True


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def with_cached_tokens(body: bytes, cached_tokens: int) -> bytes:
    """A whole JSON answer with its usage's ``cached_tokens`` set (``body`` itself when it has
    no usage or is not JSON)."""
    if not any(u in body for u in _USAGE):
        return body
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    return _dumps(payload) if set_cached_tokens(payload, cached_tokens) else body


class EventRelay:
    """An SSE stream, re-cut into whole events (``data: …`` then a blank line), each passed on
    as it came but for its usage.

    The router asks the decode for a usage object on every event (``stream_options``
    ``include_usage`` and ``continuous_usage_stats``): each says how many tokens its choice has
    generated so far, so the policy's token count is exact even when vLLM sends several steps'
    tokens in one event. What the client did not ask for is taken out again: a choice event's
    usage (unless ``continuous``), the closing usage event (unless ``include_usage``); a usage
    that stays gets ``cached_tokens`` (``with_cached_tokens``)."""

    def __init__(
        self, cached_tokens: int, include_usage: bool = True, continuous: bool = True
    ) -> None:
        self.cached_tokens = cached_tokens
        self.include_usage = include_usage
        self.continuous = continuous and include_usage
        self.done = False  # ``data: [DONE]`` passed
        self._tail = b""
        self._tokens = 0  # tokens generated since ``take_tokens``
        self._per_choice: dict[int, int] = {}  # choice index → its tokens so far

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that ``chunk`` completes (possibly none)."""
        self._tail += chunk
        *events, self._tail = self._tail.split(b"\n\n")
        return b"".join(out + b"\n\n" for e in events if (out := self._event(e)))

    def take_tokens(self) -> int:
        """The tokens generated since the last call (from the events' usage; one per event
        with a choice where an event has none)."""
        n, self._tokens = self._tokens, 0
        return n

    def flush(self) -> bytes:
        """What is left once the stream ended (an event without its blank line)."""
        rest, self._tail = self._tail, b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if event.startswith(b"data: [DONE]"):
            self.done = True
            return event
        if not event.startswith(b"data: "):
            return event
        body = event[6:]
        choice = any(c in body for c in _CHOICE)
        span = usage_span(body)
        if span is None:
            if choice and _OPENING not in body:
                self._tokens += 1
            return event
        start, end = span
        if choice:
            self._count(body, body[start + len(_USAGE_KEY) : end])
            if not self.continuous:
                return b"data: " + body[:start] + body[end:]
        elif not self.include_usage:  # the closing usage event the client did not ask for
            return b""
        return b"data: " + with_cached_tokens(body, self.cached_tokens)

    def _count(self, body: bytes, usage: bytes) -> None:
        try:
            so_far = int(json.loads(usage).get("completion_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            self._tokens += 1
            return
        m = _INDEX.search(body)
        index = int(m.group(1)) if m else 0
        before = self._per_choice.get(index, 0)
        if so_far > before:
            self._tokens += so_far - before
            self._per_choice[index] = so_far


_USAGE_KEY = b',"usage":'
_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')


def usage_span(body: bytes) -> tuple[int, int] | None:
    """Where ``,"usage":{…}`` (or ``null``) sits in a compact JSON event of vLLM's (start, end:
    the bytes to cut to remove it); None if it has none. A usage object holds numbers and
    objects of numbers only, so its end is found by counting braces."""
    start = body.find(_USAGE_KEY)
    if start < 0:
        return None
    at = start + len(_USAGE_KEY)
    if body.startswith(b"null", at):
        return start, at + 4
    if body[at : at + 1] != b"{":
        return None
    depth = 0
    for i in range(at, len(body)):
        c = body[i]
        if c == 0x7B:  # {
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return start, i + 1
    return None
