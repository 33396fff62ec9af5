"""The Responses API's input items as chat messages (``messages_of``): messages, function calls
(joined to the assistant turn before them), their outputs (tool messages), and reasoning items
(kept as the next assistant turn's ``reasoning_content``, which templates read). Pure.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from dualpath.frontend.schema import ApiError, describe


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MessageItem(_Base):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Base):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Base):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(_Base):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "".join(str(p.get("text", "")) for p in parts)


_ITEMS: dict[str, type[_Base]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for k, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}.{k}: only input_text and output_text parts are supported (got {kind!r})",
                f"{where}.{k}.type",
            )
        out.append(part["text"])
    return "".join(out)


def messages_of(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant message before it
    (as chat clients send text and calls of one turn), a call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn it precedes
    for i, raw in enumerate(items):
        item = _item(i, raw)
        if isinstance(item, ReasoningItem):
            thought += item.text()
            continue
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content, f"input.{i}.content")})
        elif isinstance(item, FunctionCallItem):
            try:
                args = json.loads(item.arguments or "{}")
            except ValueError:
                raise ApiError(
                    400, f"input.{i}.arguments: not valid JSON", f"input.{i}.arguments"
                ) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": args},
            }
            if out and out[-1]["role"] == "assistant" and not thought:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            text = _text(item.output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        if thought and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], thought = thought, ""
    return out


def _item(i: int, raw: dict[str, Any]) -> _Base:
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ApiError(
            400,
            f"input.{i}.type: {kind!r} items are not supported (only {', '.join(_ITEMS)})",
            f"input.{i}.type",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ApiError(400, f"input.{i}.{message}", f"input.{i}.{param}") from None
