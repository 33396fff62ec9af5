"""A chat request's prompt: its messages as chat templates take them, rendered with its tools,
``documents``, ``add_generation_prompt`` and ``chat_template_kwargs`` through transformers'
renderer (``frontend/tokenizer.py``). A template error is a 400 naming the field that caused it
(the one whose removal lets the template render). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dualpath.frontend.schema import ApiError, ChatMessage, ChatRequest
from dualpath.frontend.tokenizer import RESERVED_TEMPLATE_KWARGS, ChatInputs, TextTokenizer
from dualpath.frontend.tools import Tool


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: calls' arguments as objects (as transformers'
    templates expect), a tool result's ``tool_call_id`` kept."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.reasoning_content:  # (Qwen3 / R1 templates read it; most drop it from history)
            d["reasoning_content"] = m.reasoning_content
        if m.name:
            d["name"] = m.name
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(
                    400,
                    f"messages.{i}.tool_call_id: required for a tool message",
                    f"messages.{i}.tool_call_id",
                )
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for k, c in enumerate(m.tool_calls):
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except ValueError:
                        where = f"messages.{i}.tool_calls.{k}.function.arguments"
                        raise ApiError(400, f"{where}: not valid JSON", where) from None
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": args},
                    }
                )
            d["tool_calls"] = calls
        out.append(d)
    return out


def render_prompt(body: ChatRequest, tokenizer: TextTokenizer, tools: Sequence[Tool]) -> str:
    """The prompt text of ``body`` (400s name the field at fault)."""
    kwargs = body.chat_template_kwargs or {}
    for key in sorted(kwargs):
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ApiError(
                400,
                f"chat_template_kwargs.{key}: set by the server, not here",
                f"chat_template_kwargs.{key}",
            )
    inputs = ChatInputs(
        tools=tuple(t.openai() for t in tools),
        documents=tuple(d.model_dump() for d in body.documents or ()),
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=tuple(sorted(kwargs.items())),
    )
    messages = template_messages(body.messages)
    try:
        text = tokenizer.render_chat(messages, inputs)
    except ValueError as exc:
        param = _culprit(tokenizer, messages, inputs)
        raise ApiError(400, f"{param}: {exc}", param) from None
    if tools and text == tokenizer.render_chat(messages, replace(inputs, tools=())):
        raise ApiError(400, "tools: this model's chat template does not render tools", "tools")
    if body.documents and text == tokenizer.render_chat(messages, replace(inputs, documents=())):
        raise ApiError(
            400, "documents: this model's chat template does not render documents", "documents"
        )
    return text


def _culprit(tokenizer: TextTokenizer, messages: list[dict[str, Any]], inputs: ChatInputs) -> str:
    """The field whose removal lets the template render (else messages)."""
    for field, without in (
        ("tools", replace(inputs, tools=())),
        ("documents", replace(inputs, documents=())),
        ("chat_template_kwargs", replace(inputs, template_kwargs=())),
    ):
        if without == inputs:
            continue
        try:
            tokenizer.render_chat(messages, without)
        except ValueError:
            continue
        return field
    return "messages"
