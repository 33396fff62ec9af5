"""Tool calls in a model's text: the per-family formats, streaming parsers that split the
text into content and calls, and the grammar that forces a call (``tool_choice`` required
or named). Pure: no I/O; llguidance only builds grammar text.

Formats (``TOOL_FORMATS``): ``hermes`` (Qwen 2.5 / 3, Hermes, the default ChatML template):
``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``, any number, text around them
is content; ``llama3_json`` (Llama 3.1+): the whole reply is ``{"name": …, "parameters": {…}}``
(optionally after ``<|python_tag|>``), several joined by ``;``; a reply that does not parse so
stays content. Unknown text is never dropped: it stays content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.serve.strict import StrictSchema

TOOL_FORMATS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool of a request: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: Any = None  # a JSON-schema object (None: an object without arguments)
    strict: bool = True  # ``strict: false`` on the request's tool: extra keys allowed

    def schema(self) -> dict[str, Any]:
        """The schema as the request gave it (what the chat template renders)."""
        p = self.parameters
        return p if isinstance(p, dict) and p else {"type": "object"}

    def grammar_schema(self) -> dict[str, Any]:
        """The schema its calls are constrained to: strict unless the tool opts out, and
        bounded (``serve/strict.py``)."""
        return StrictSchema(strict=self.strict).apply(self.schema())

    def openai(self) -> dict[str, Any]:
        """As chat templates take it (``tools=[{"type": "function", "function": …}]``)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.schema()}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (as OpenAI returns it)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that could start ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Feed text deltas; get back content that is safe to send and every call completed."""

    def __init__(self, fmt: str) -> None:
        if fmt not in TOOL_FORMATS:
            raise ValueError(f"tool format {fmt!r} is invalid: must be one of {TOOL_FORMATS}")
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._json_reply: bool | None = None  # llama3_json: does the reply start with '{'?
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self.fmt == "llama3_json":
            return self._feed_llama()
        return self._feed_hermes(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.fmt == "llama3_json":
            return self._finish_llama()
        return self._feed_hermes(final=True)

    # -- hermes -------------------------------------------------------------------------------
    def _feed_hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            if not self._in_call:
                at = self._buf.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _held_prefix(self._buf, _OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(_OPEN) :]
                self._in_call = True
            end = self._buf.find(_CLOSE)
            if end < 0 and not final:
                break
            body = self._buf if end < 0 else self._buf[:end]
            call = _parse_json_call(body, "arguments", unclosed=end < 0)
            if call is None:  # not a call after all: what the model wrote stays content
                tail = "" if end < 0 else _CLOSE
                content.append(_OPEN + body + tail)
            else:
                calls.append(call)
            self._buf = "" if end < 0 else self._buf[end + len(_CLOSE) :]
            self._in_call = False
            if end < 0:
                break
        self.calls.extend(calls)
        return "".join(content), calls

    # -- llama 3 JSON -------------------------------------------------------------------------
    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if self._json_reply is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            if _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]) and len(head) < len(_PYTHON_TAG):
                return "", []  # could still be the tag
            self._json_reply = head.startswith(("{", _PYTHON_TAG))
        if self._json_reply:
            return "", []  # a call (or not) is known at the end only
        out, self._buf = self._buf, ""
        return out, []

    def _finish_llama(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if not self._json_reply:
            return text, []
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        calls = []
        for part in _split_top_level(body, ";"):
            call = _parse_json_call(part, "parameters")
            if call is None:
                return text, []  # not (all) calls: the reply is content, as written
            calls.append(call)
        self.calls.extend(calls)
        return "", calls


def _parse_json_call(text: str, args_key: str, unclosed: bool = False) -> ToolCall | None:
    """The call ``text`` holds; ``unclosed``: the reply ended inside the call's tags (cut
    by max_tokens), so after the JSON may come the start of the closing tag."""
    try:
        if not unclosed:
            return _call_from(json.loads(text), args_key)
        stripped = text.lstrip()
        obj, end = json.JSONDecoder().raw_decode(stripped)
        rest = stripped[end:].strip()
        if rest and not _CLOSE.startswith(rest):
            return None
        return _call_from(obj, args_key)
    except ValueError:
        return None


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def call_grammar(tools: Sequence[Tool], fmt: str) -> str:
    """llguidance grammar text for exactly one call of one of ``tools`` in ``fmt``: the name
    is one of theirs, the arguments match its schema; compact JSON (no free whitespace), so
    even a random model ends within a few dozen tokens when the schemas bound their values."""
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.grammar_schema()},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    call = "%json " + json.dumps(schema)
    if fmt == "llama3_json":
        return f"start: call\ncall: {call}\n"
    return f'start: "{_OPEN}\\n" call "\\n{_CLOSE}"\ncall: {call}\n'


def json_grammar(schema: Any, strict: bool = True) -> str:
    """llguidance grammar text for one JSON value matching ``schema`` (compact JSON; strict
    and bounded as ``serve/strict.py`` makes it); None: ``json_object`` (a bounded object)."""
    import llguidance

    rules = StrictSchema(strict=strict)
    body = rules.free_object() if schema is None else rules.apply(schema)
    return str(
        llguidance.LLMatcher.grammar_from_json_schema(
            body, defaults={"whitespace_flexible": False}
        )
    )


def grammar_error(grammar: str) -> str:
    """Why llguidance rejects ``grammar`` ('' when it is valid)."""
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(grammar))
