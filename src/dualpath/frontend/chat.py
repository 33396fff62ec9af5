"""What a chat request asks beyond tokens: the prompt its messages and tools render to, the
grammar its ``tool_choice`` / ``response_format`` impose, how its replies are read back
(content, tool calls, log-probabilities). Pure: the API routes call it; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.frontend.reasoning import (
    REASONING_PARSERS,
    prompt_opens_reasoning,
    reasoning_grammar,
)
from dualpath.frontend.render import render_prompt
from dualpath.frontend.schema import ApiError, ChatRequest, ResponseFormat
from dualpath.frontend.strict import StrictSchema
from dualpath.frontend.tokenizer import TextTokenizer
from dualpath.frontend.tool_families import TOOL_PARSERS
from dualpath.frontend.tool_parsers import CallDelta
from dualpath.frontend.tools import Tool, ToolCall, json_grammar
from dualpath.tokens import TokenLogprob


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A validated chat request: ``prompt`` token ids, the ``grammar`` (or ''), ``parse``:
    the tool format its replies are parsed with (None: all content), ``forced``: a call is
    required (``tool_choice`` required / named); ``grammar_param``: the field the grammar
    comes from (what a refusal of it names; ``frontend/grammars.py`` checks it)."""

    prompt: list[int]
    grammar: str
    parse: str | None
    forced: bool
    grammar_param: str = ""
    tools: tuple[Tool, ...] = ()
    max_calls: int | None = None  # 1: parallel_tool_calls is false
    reasoning: str | None = None  # a REASONING_PARSERS name
    reasoning_opened: bool = False  # the prompt ends inside <think>

    def reader(self) -> ReplyReader:
        return ReplyReader(
            self.parse, self.tools, self.max_calls, self.reasoning, self.reasoning_opened
        )

    @property
    def needs_special_tokens(self) -> bool:
        """Its tool format's markers are special tokens: decode replies with them."""
        return self.parse is not None and TOOL_PARSERS[self.parse].needs_special_tokens


def plan_chat(
    body: ChatRequest,
    tokenizer: TextTokenizer,
    tool_format: str,
    supports_grammar: bool,
    max_schema_bytes: int = 0,
    reasoning: str = "",
) -> ChatPlan:
    """Render and validate ``body`` (every refusal a 400 naming its field).
    ``max_schema_bytes`` (0: none): the tools' and the JSON schema's size, checked before
    anything is built from them (rendering, grammar; ``frontend/grammars.py``); ``reasoning``:
    the ``--reasoning-parser`` ('' none): replies' ``<think>`` is split off, and a grammar
    lets the model think first."""
    if tool_format not in TOOL_PARSERS:
        raise ValueError(
            f"tool_format={tool_format!r} is invalid: must be one of {sorted(TOOL_PARSERS)}"
        )
    tools = [
        Tool(
            t.function.name,
            t.function.description,
            t.function.parameters,
            t.function.strict is not False,
        )
        for t in body.tools or ()
    ]
    if len({t.name for t in tools}) != len(tools):
        raise ApiError(400, "tools: two tools have the same name", "tools")
    if max_schema_bytes:
        _check_schema_size(body, tools, max_schema_bytes)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise ApiError(400, "tool_choice: needs tools", "tool_choice")
    text = render_prompt(body, tokenizer, tools)
    forced_tools: list[Tool] = []
    if choice == "required":
        forced_tools = tools
    elif not isinstance(choice, str):
        forced_tools = [t for t in tools if t.name == choice.function.name]
        if not forced_tools:
            raise ApiError(
                400, f"tool_choice: no tool named {choice.function.name!r}", "tool_choice"
            )
    grammar = _grammar(
        body.response_format, tools if choice == "auto" else [], forced_tools, tool_format
    )
    opened = bool(reasoning) and prompt_opens_reasoning(text)
    if grammar and reasoning:
        grammar = reasoning_grammar(grammar, opened)
    param = ""
    if grammar:
        param = "tool_choice" if forced_tools else "response_format"
        if not supports_grammar:
            raise ApiError(400, f"{param}: this backend cannot constrain decoding", param)
        if body.ignore_eos:
            raise ApiError(400, f"ignore_eos: cannot be combined with {param}", "ignore_eos")
        fmt = body.response_format
        if not forced_tools and fmt is not None and fmt.type == "json_schema":
            param = "response_format.json_schema"
        elif choice == "auto" and not fmt:
            param = "tools"
    return ChatPlan(
        prompt=tokenizer.encode(text),
        grammar=grammar,
        parse=tool_format if choice != "none" else None,
        forced=bool(forced_tools),
        grammar_param=param,
        tools=tuple(tools),
        max_calls=1 if body.parallel_tool_calls is False else None,
        reasoning=reasoning or None,
        reasoning_opened=opened,
    )


def _check_schema_size(body: ChatRequest, tools: list[Tool], limit: int) -> None:
    """A 400 for tools or a JSON schema larger than ``limit`` bytes of JSON (a grammar is
    about as large as its schema; building one from a 400 kB schema takes 50 ms)."""
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        size = len(json.dumps(fmt.json_schema.schema_ or {}))
        if size > limit:
            raise ApiError(
                400,
                f"response_format.json_schema: {size} bytes of JSON schema, "
                f"over the server's limit of {limit} (--max-grammar-bytes)",
                "response_format.json_schema",
            )
    size = sum(len(json.dumps(t.schema())) for t in tools)
    if size > limit:
        raise ApiError(
            400,
            f"tools: {size} bytes of parameter schemas, over the server's "
            f"limit of {limit} (--max-grammar-bytes)",
            "tools",
        )


def _grammar(
    fmt: ResponseFormat | None, optional: list[Tool], forced: list[Tool], tool_format: str
) -> str:
    """The grammar of a reply: a forced call; else, with a JSON ``response_format``, JSON of
    its schema (or, with tools on ``auto``, that or a call); else none."""
    if forced:
        return TOOL_PARSERS[tool_format].call_grammar(forced)
    if fmt is None or fmt.type == "text":
        return ""
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format.json_schema: required for type json_schema",
                "response_format.json_schema",
            )
        schema: dict[str, Any] | None = fmt.json_schema.schema_ or {"type": "object"}
        strict = fmt.json_schema.strict is not False
    else:
        schema, strict = None, True  # json_object: a bounded free object
    if not optional:
        return json_grammar(schema, strict)
    rules = StrictSchema(strict=strict)
    body = rules.free_object() if schema is None else rules.apply(schema)
    value = "%json " + json.dumps({**body, "x-guidance": {"whitespace_flexible": False}})
    call = TOOL_PARSERS[tool_format].call_grammar(optional).replace("start:", "tool_call:", 1)
    return f"start: answer | tool_call\nanswer: {value}\n{call}"


# -- replies --------------------------------------------------------------------------------


def chat_logprobs(tokenizer: TextTokenizer, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def completion_logprobs(
    tokenizer: TextTokenizer, lps: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(tokenizer.decode([lp.token]))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


@dataclass(frozen=True, slots=True)
class ReplyPiece:
    """What a reply's next text adds: ``content`` and ``reasoning`` deltas, tool-call
    argument ``deltas``, and the calls it completed (``done``)."""

    content: str = ""
    reasoning: str = ""
    deltas: tuple[CallDelta, ...] = ()
    done: tuple[ToolCall, ...] = ()


class ReplyReader:
    """One choice's reply as it streams: text deltas in, ``ReplyPiece``s out (``parse``: a
    ``TOOL_PARSERS`` name, None: no tool calls; ``reasoning``: a ``REASONING_PARSERS`` name,
    whose ``<think>`` part never reaches the tool parser)."""

    def __init__(
        self,
        parse: str | None,
        tools: Sequence[Tool] = (),
        max_calls: int | None = None,
        reasoning: str | None = None,
        opened: bool = False,
    ) -> None:
        self.parser = TOOL_PARSERS[parse](tools, max_calls) if parse else None
        self.thinker = REASONING_PARSERS[reasoning](opened) if reasoning else None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool = False) -> ReplyPiece:
        """What ``text`` adds (``final``: the reply ended with it)."""
        thought = ""
        if self.thinker is not None:
            thought, text = self.thinker.feed(text, final)
            self.reasoning.append(thought)
        if self.parser is None:
            self.content.append(text)
            return ReplyPiece(text, thought)
        content, deltas = self.parser.feed(text)
        if final:
            tail, more = self.parser.finish()
            content, deltas = content + tail, deltas + more
        self.content.append(content)
        done = self.parser.calls[len(self.calls) :]
        self.calls.extend(done)
        return ReplyPiece(content, thought, tuple(deltas), tuple(done))

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
