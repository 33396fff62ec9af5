"""A request body from bytes to a JSON object, each limit checked before the step it protects:
the size while the body streams in, the nesting depth before ``json.loads``, integer digits
and ``NaN`` / ``Infinity`` while parsing, lone surrogates after. Raises ``BodyError``; no HTTP.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

MAX_DEPTH = 64  # nested arrays / objects; a chat request needs about 5
MAX_INT_DIGITS = 20  # 2**64 has 20 digits: any longer integer is out of every field's range

# a JSON string, escapes included (unrolled: no backtracking per character)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # UTF-8 text carries them only escaped


class BodyError(ValueError):
    """A body the API rejects: ``status`` (400 or 413), the message, the field (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def read_limited(
    chunks: AsyncIterator[bytes], content_length: str | None, max_bytes: int
) -> bytes:
    """The whole body, holding at most ``max_bytes`` plus one chunk: 413 at once for a declared
    ``content_length`` over it, else 413 as soon as the streamed (chunked) total passes it."""
    if content_length is not None:
        size = int(content_length) if content_length.isdigit() else -1
        if size < 0:
            raise BodyError(400, f"Content-Length {content_length!r} is not a byte count")
        if size > max_bytes:
            raise BodyError(413, f"request body of {size} bytes exceeds {max_bytes} bytes")
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > max_bytes:
            raise BodyError(413, f"request body exceeds {max_bytes} bytes")
    return bytes(buf)


def decode_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw`` (UTF-8); BodyError (400) for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"request body is not valid UTF-8: {exc}") from None
    if is_deeper_than(text, MAX_DEPTH):
        raise BodyError(400, f"request body nests JSON deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise BodyError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # unreachable after the depth scan; never a 500 if it were
        raise BodyError(400, "request body nests JSON too deep") from None
    if not isinstance(data, dict):
        raise BodyError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text) and (path := lone_surrogate_at(data)) is not None:
        shown = path.encode("utf-8", "backslashreplace").decode()  # a key may hold one too
        raise BodyError(400, f"{shown}: invalid Unicode (a lone surrogate)", shown)
    return data


def is_deeper_than(text: str, max_depth: int) -> bool:
    """Whether JSON ``text`` nests arrays / objects more than ``max_depth`` deep, without
    recursion and in linear time: strings are cut out (brackets in them do not count), then
    the depth is the running sum of +1 per opening and -1 per closing bracket. Malformed text
    may be judged either way; ``json.loads`` rejects it anyway."""
    if text.count("[") + text.count("{") <= max_depth:
        return False  # the common case, at C speed
    code = np.frombuffer(_STRING.sub("", text).encode("utf-8", "surrogatepass"), np.uint8)
    opens = (code == ord("[")) | (code == ord("{"))
    closes = (code == ord("]")) | (code == ord("}"))
    depth = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32))
    return bool(depth.size) and int(depth.max()) > max_depth


def lone_surrogate_at(data: Any) -> str | None:
    """The dotted path (``messages.0.content``, as in validation errors) of a key or string
    value holding a lone surrogate (a JSON escape like ``"\\ud800"``), or None."""
    # (value, link): a link is (parent link, key or index), so a path is built only when found
    stack: list[tuple[Any, Any]] = [(data, None)]
    while stack:
        value, link = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return _dotted(link)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return _dotted((link, key))
                stack.append((item, (link, key)))
        elif isinstance(value, list):
            stack.extend((item, (link, i)) for i, item in enumerate(value))
    return None


def _dotted(link: Any) -> str:
    parts = []
    while link is not None:
        link, key = link
        parts.append(str(key))
    return ".".join(reversed(parts))


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BodyError(
            400, f"request body has an integer of {digits} digits (at most {MAX_INT_DIGITS})"
        )
    return int(text)


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"request body is not valid JSON: {name} is not a JSON number")
