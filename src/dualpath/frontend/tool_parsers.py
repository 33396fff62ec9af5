"""Tool-call parsers, one small class per model family, registered by name (``TOOL_PARSERS``,
as vLLM's ``ToolParserManager``): each reads a reply's text into content and calls, whole
(``parse``) or as it streams (``feed`` / ``finish``: content deltas and argument deltas that
concatenate to the whole-text arguments), and builds the grammar that forces one call.
Pure: no I/O.

One mechanism serves both ways: a family's ``scan`` reads the text so far into content and
calls whose arguments are the raw JSON text written so far (never past its end); the stream
sends what grew since the last scan. A call is exposed once its name and the start of its
arguments are read; a body that never becomes a call stays content (in a stream, when no
part of it was sent as a call). Families: ``frontend/tool_families.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dualpath.frontend.tools import Tool, ToolCall, new_call_id


@dataclass(slots=True)
class PartialCall:
    """A call as far as it is read: ``arguments`` is JSON text (complete when ``done``)."""

    name: str
    arguments: str = ""
    done: bool = False


@dataclass(slots=True)
class Scan:
    """What ``text`` so far holds: the ``content`` safe to send, and the calls."""

    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of the ``index``-th call: its id and name in its first delta only."""

    index: int
    arguments: str
    id: str = ""
    name: str = ""

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": fn}
        if self.name:
            fn["name"] = self.name
            out.update(id=self.id, type="function")
        return out


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array that starts at ``text[start]`` (None while
    it is still open; ``start`` for any other value: scalars are not streamed)."""
    if start >= len(text) or text[start] not in "{[":
        return start
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def valid_arguments(text: str) -> str | None:
    """``text`` as a call's arguments (a JSON object; a JSON string holding one is decoded),
    or None."""
    try:
        value = json.loads(text)
        if isinstance(value, str):
            value = json.loads(value)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return text.strip() if text.lstrip().startswith("{") else json.dumps(value, ensure_ascii=False)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that could start ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
PENDING = PartialCall("")  # a body not yet readable either way: hold it


def read_json_call(body: str, complete: bool) -> PartialCall | None:
    """The call in ``body`` (``{"name": …, "arguments": {…}}``); ``complete``: nothing more
    comes, so it is a call or not (None). While incomplete: PENDING when undecided."""
    m = _HEAD.match(body)
    if m is not None:
        name, start = json.loads(f'"{m.group(1)}"'), m.end()
        end = json_end(body, start)
        if not complete:
            return PartialCall(name, body[start:] if end is None else body[start:end])
        if end is not None and end > start and body[end:].strip() == "}":
            args = valid_arguments(body[start:end])
            return None if args is None else PartialCall(name, args, done=True)
    if not complete:
        return PENDING
    try:  # another key order, or arguments as a JSON string
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    raw = obj.get("arguments", obj.get("parameters", {}))
    args = valid_arguments(raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False))
    return None if args is None else PartialCall(obj["name"], args, done=True)


def tagged(
    text: str, final: bool, open_: str, close: str, read: Callable[[str, bool], PartialCall | None]
) -> Scan:
    """Calls between ``open_`` and ``close`` tags, text around them content; ``read(body,
    complete)`` reads one body (None: not a call, it stays content; PENDING: hold)."""
    out, pos = Scan(), 0
    while True:
        at = text.find(open_, pos)
        if at < 0:
            tail = text[pos:]
            out.content += tail[: len(tail) - (0 if final else held_prefix(tail, open_))]
            return out
        out.content += text[pos:at]
        start = at + len(open_)
        end = text.find(close, start)
        body = text[start:] if end < 0 else text[start:end]
        if end < 0 and final:  # cut by max_tokens, perhaps inside the closing tag
            body = body[: len(body) - held_prefix(body, close)]
        call = read(body, end >= 0 or final)
        if call is PENDING:
            return out
        if call is None:
            out.content += text[at:] if end < 0 else text[at : end + len(close)]
        else:
            out.calls.append(call)
        if end < 0:
            return out
        pos = end + len(close)


class ToolParser:
    """A family's parser for one reply. Subclasses set ``name`` and define ``scan`` and
    ``call_grammar``; ``tools``: the request's tools (for families that type arguments by
    their schemas); ``max_calls``: 1 when ``parallel_tool_calls`` is false (later calls are
    dropped, as vLLM does). ``needs_special_tokens``: its markers are special tokens, so its
    replies are decoded with them."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[Tool] = (), max_calls: int | None = None) -> None:
        self.tools = {t.name: t for t in tools}
        self.max_calls = max_calls
        self._text = ""
        self._sent_content = 0
        self._sent: list[tuple[str, int]] = []  # per exposed call: its id, argument chars sent
        self.calls: list[ToolCall] = []  # every call complete so far, in order

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        raise NotImplementedError

    # -- whole text -----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content and calls of a whole reply."""
        self._text, self._sent_content, self._sent, self.calls = "", 0, [], []
        content, _ = self.feed(text)
        tail, _ = self.finish()
        return content + tail, list(self.calls)

    # -- streaming ------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Content and call pieces that are safe to send after ``text`` more of the reply."""
        self._text += text
        return self._step(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest, at the reply's end; ``self.calls`` then holds every call."""
        return self._step(final=True)

    def _scan(self, final: bool) -> Scan:
        s = self.scan(self._text, final)
        if final:
            s.calls = [c for c in s.calls if c.done]
        if self.max_calls is not None:
            s.calls = s.calls[: self.max_calls]
        return s

    def _step(self, final: bool) -> tuple[str, list[CallDelta]]:
        s = self._scan(final)
        content = s.content[self._sent_content :]
        self._sent_content = max(self._sent_content, len(s.content))
        deltas: list[CallDelta] = []
        for i, call in enumerate(s.calls):
            if i == len(self._sent):
                cid = new_call_id()
                self._sent.append((cid, len(call.arguments)))
                deltas.append(CallDelta(i, call.arguments, cid, call.name))
            elif i < len(self._sent):
                cid, sent = self._sent[i]
                if len(call.arguments) > sent:
                    self._sent[i] = (cid, len(call.arguments))
                    deltas.append(CallDelta(i, call.arguments[sent:]))
            if call.done and i == len(self.calls) and i < len(self._sent):
                self.calls.append(ToolCall(self._sent[i][0], call.name, call.arguments))
        return content, deltas
