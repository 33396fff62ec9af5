"""The decode instance's answer on its way to the client, as vLLM wrote it but for one field:
``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens the store served (vLLM would
count the whole buffer load: prompt − 1 on every turn, a cold one included).

Pure: bytes in, bytes out. ``EventRelay`` cuts an SSE byte stream into whole events (only the
events carrying a usage object are parsed and written again), counts the tokens they bring
(vLLM sends one event per engine step and choice) and says when ``[DONE]`` passed.
"""

from __future__ import annotations

import json
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
    """An SSE stream, re-cut into whole events (``data: …`` then a blank line), with the
    usage of each event that has one rewritten by ``with_cached_tokens``."""

    def __init__(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens
        self.done = False  # ``data: [DONE]`` passed
        self._tail = b""
        self._tokens = 0  # events with a token since ``take_tokens``

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that ``chunk`` completes (possibly none)."""
        self._tail += chunk
        *events, self._tail = self._tail.split(b"\n\n")
        return b"".join(self._event(e) + b"\n\n" for e in events)

    def take_tokens(self) -> int:
        """The tokens of the events since the last call (one per event with a choice)."""
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
        if any(c in event for c in _CHOICE) and _OPENING not in event:
            self._tokens += 1
        if not any(u in event for u in _USAGE):
            return event
        return b"data: " + with_cached_tokens(event[6:], self.cached_tokens)
