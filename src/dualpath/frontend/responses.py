"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request's input items
become chat messages (same prompt, grammar and reply parsing as chat, so the same tokens);
the reply comes back as output items, whole or as OpenAI's stream events. Nothing is stored:
``previous_response_id`` and ``store=true`` are refused, as is any field it cannot honour.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dualpath.frontend.backend import BackendFailure, TokenEvent
from dualpath.frontend.chat import ReplyReader, chat_logprobs, plan_chat
from dualpath.frontend.response_input import messages_of
from dualpath.frontend.schema import MAX_TOKENS, MAX_TOP_LOGPROBS, ApiError, ChatRequest, describe
from dualpath.frontend.service import DeadlinePassed, Service
from dualpath.frontend.tokenizer import TextTokenizer
from dualpath.frontend.tools import ToolCall
from dualpath.tokens import TokenLogprob

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value this server honours
_CHAT_NAMES = {"response_format": "text.format", "messages": "input"}  # chat's names → ours


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Base):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Base):
    type: Literal["function"]
    name: str


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a plain model has


class ResponsesRequest(_Base):
    """The fields of ``responses.create`` this server honours (any other is a 400)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    stream: bool = False
    store: Literal[False] | None = None  # nothing is stored
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = None  # echoed, never changes the answer
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    previous_response_id: str | None = None  # refused: no state is kept
    reasoning: dict[str, Any] | None = None  # refused unless null

    def to_chat(self) -> ChatRequest:
        """The chat request of the same conversation (every refusal a 400 naming its field)."""
        if self.previous_response_id is not None:
            raise ApiError(
                400,
                "previous_response_id: not supported: this server stores no "
                "responses; send the whole conversation as input",
                "previous_response_id",
            )
        if self.reasoning is not None:
            raise ApiError(400, "reasoning: not supported by this model", "reasoning")
        if self.top_logprobs is not None and LOGPROBS not in (self.include or ()):
            raise ApiError(400, f"top_logprobs: needs include=[{LOGPROBS!r}]", "top_logprobs")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += messages_of(self.input)
        if not messages:
            raise ApiError(400, "input: no items", "input")
        fmt = self.text.format if self.text else None
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": LOGPROBS in (self.include or ()),
            "top_logprobs": self.top_logprobs,
        }
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": t.parameters,
                        "strict": t.strict,
                    },
                }
                for t in self.tools
            ]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            chat["tool_choice"] = self.tool_choice
        if fmt is not None:
            chat["response_format"] = {"type": fmt.type}
            if fmt.type == "json_schema":
                if fmt.schema_ is None:
                    raise ApiError(
                        400,
                        "text.format.schema: required for type json_schema",
                        "text.format.schema",
                    )
                chat["response_format"]["json_schema"] = {
                    "name": fmt.name,
                    "description": fmt.description,
                    "schema": fmt.schema_,
                    "strict": fmt.strict,
                }
        try:
            return ChatRequest.model_validate(chat)
        except ValidationError as exc:
            message, param = describe(exc)
            raise ApiError(400, message, param) from None

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        choice: Any = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in self.tools or ()],
            "top_logprobs": self.top_logprobs,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


def _renamed(exc: ApiError) -> ApiError:
    """A chat-path refusal under the Responses API's names for the same fields."""
    for chat, ours in _CHAT_NAMES.items():
        if exc.param and exc.param.split(".")[0] == chat:
            message = exc.message.replace(chat, ours, 1)
            return ApiError(exc.status, message, exc.param.replace(chat, ours, 1))
    return exc


class ResponseWriter:
    """One response as its reply streams: text deltas in, Responses stream events out, and
    the Response object at any point. Content becomes a message item (opened at its first
    text), each tool call a ``function_call`` item after it; text after a call opens a new
    message. The whole response is built by the same writer, so it equals the stream."""

    def __init__(
        self,
        body: ResponsesRequest,
        rid: str,
        model: str,
        reader: ReplyReader,
        tokenizer: TextTokenizer,
        logprobs: bool,
    ) -> None:
        self.rid, self.body, self.model = rid, body, model
        self.created_at = int(time.time())
        self.reader = reader
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.first: TokenEvent | None = None
        self.last: TokenEvent | None = None
        self._seq = 0
        self._message: dict[str, Any] | None = None  # the open message item
        self._reasoning: dict[str, Any] | None = None  # the reasoning item
        self._lps: list[TokenLogprob] = []  # held until their text is sent

    def response(self) -> dict[str, Any]:
        usage = None
        if self.first is not None and self.last is not None and self.status != "in_progress":
            n_in, n_out = self.first.num_prompt_tokens, self.last.num_generated_tokens
            usage = {
                "input_tokens": n_in,
                "input_tokens_details": {
                    "cached_tokens": self.first.num_cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n_in + n_out,
            }
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "usage": usage,
            **self.body.echo(),
        }

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, ev: TokenEvent) -> list[dict[str, Any]]:
        self.first = self.first or ev
        self.last = ev
        self._lps.extend(ev.logprobs)
        piece = self.reader.feed(ev.text)
        return self._think(piece.reasoning) + self._emit(piece.content, piece.done)

    def finish(self, reason: str | None) -> list[dict[str, Any]]:
        """Close the reply that ended with ``reason`` ('stop', 'length', 'abort')."""
        if reason not in ("stop", "length"):
            return self.fail("the request was aborted (server shutting down)")
        piece = self.reader.feed("", final=True)
        events = self._think(piece.reasoning) + self._emit(piece.content, piece.done)
        self.status = "incomplete" if reason == "length" else "completed"
        events += self._close_reasoning()
        if not any(item["type"] != "reasoning" for item in self.output):
            events += self._open_message()[1]  # an empty reply is an empty message
        events += self._close_message()
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.response())]

    def fail(self, message: str) -> list[dict[str, Any]]:
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _think(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text: into the reasoning item before the answer (opened at its first
        text; ``--reasoning-parser``)."""
        if not text:
            return []
        events, item = [], self._reasoning
        if item is None:
            item = self._reasoning = {
                "type": "reasoning",
                "id": "rs_" + uuid.uuid4().hex,
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self.output.append(item)
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item=copy.deepcopy(item),
                )
            )
            item["content"].append({"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        at = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **at, delta=text)]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item = self._reasoning
        if item is None or item["status"] != "in_progress":
            return []
        item["status"] = "completed"
        at = {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **at, text=item["content"][0]["text"]),
            self._event(
                "response.output_item.done",
                output_index=at["output_index"],
                item=copy.deepcopy(item),
            ),
        ]

    def _emit(self, text: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
        events = [] if not (text or calls) else self._close_reasoning()
        if text:
            message = self._message
            if message is None:
                message, opened = self._open_message()
                events += opened
            part = message["content"][0]
            part["text"] += text
            lps = self._logprobs()
            part["logprobs"] += lps
            events.append(
                self._event(
                    "response.output_text.delta", **self._at(message), delta=text, logprobs=lps
                )
            )
        for call in calls:
            events += self._close_message()
            events += self._call(call)
        return events

    def _logprobs(self) -> list[dict[str, Any]]:
        lps, self._lps = self._lps, []
        return chat_logprobs(self.tokenizer, lps)["content"] if self.logprobs else []

    def _at(self, message: dict[str, Any]) -> dict[str, Any]:
        """Where the open message's text is (it is always the last item while open)."""
        return {"item_id": message["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _open_message(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        message: dict[str, Any] = {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._message = message
        self.output.append(message)
        added = self._event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=copy.deepcopy(message),
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message["content"].append(part)
        at = self._at(message)
        return message, [
            added,
            self._event("response.content_part.added", **at, part=copy.deepcopy(part)),
        ]

    def _close_message(self) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message["content"][0]
        part["logprobs"] += self._logprobs()
        at = self._at(message)
        message["status"] = "incomplete" if self.status == "incomplete" else "completed"
        return [
            self._event(
                "response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"]
            ),
            self._event("response.content_part.done", **at, part=copy.deepcopy(part)),
            self._event(
                "response.output_item.done",
                output_index=at["output_index"],
                item=copy.deepcopy(message),
            ),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex,
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        added = self._event(
            "response.output_item.added", output_index=at["output_index"], item=copy.deepcopy(item)
        )
        item.update(arguments=call.arguments, status="completed")
        return [
            added,
            self._event("response.function_call_arguments.delta", **at, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done",
                **at,
                name=call.name,
                arguments=call.arguments,
            ),
            self._event(
                "response.output_item.done",
                output_index=at["output_index"],
                item=copy.deepcopy(item),
            ),
        ]


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def create_response(svc: Service, request: Request) -> Response:
    """``POST /v1/responses``: whole (JSON) or streamed (SSE with OpenAI's event names)."""
    arrived = time.monotonic()
    svc.authorise(request)
    body: ResponsesRequest = await svc.parse(request, ResponsesRequest)
    backend = svc.backend
    try:
        chat = body.to_chat()
        plan = plan_chat(
            chat,
            backend.tokenizer,
            svc.opts.tool_format,
            backend.supports_grammar,
            svc.opts.grammar.max_bytes,
            svc.opts.reasoning_parser,
        )
        await svc.check_grammar(plan)
    except ApiError as exc:
        raise _renamed(exc) from None
    logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
    gen = svc.to_request(chat, plan.prompt, request, plan.grammar, logprobs, "input")
    svc.check_alive()
    if plan.needs_special_tokens:
        gen = replace(gen, skip_special_tokens=False)
    writer = ResponseWriter(
        body,
        "resp_" + gen.request_id,
        backend.model_name,
        plan.reader(),
        backend.tokenizer,
        logprobs is not None,
    )
    if not body.stream:

        def on_event(_: int, ev: TokenEvent) -> None:
            writer.feed(ev)

        lasts = await svc.whole(request, [gen], arrived, on_event)
        if lasts is None:
            return Response(status_code=499)  # nobody is listening any more
        writer.finish(lasts[0].finish_reason)
        return JSONResponse(writer.response())

    async def stream() -> AsyncIterator[str]:
        for event in writer.start():
            yield _sse(event)
        reason: str | None = None
        async with contextlib.aclosing(svc.tokens([gen], arrived)) as events:
            try:
                async for _, ev in events:
                    for event in writer.feed(ev):
                        yield _sse(event)
                    reason = ev.finish_reason or reason
            except BackendFailure as exc:  # a response.failed event, then the end
                for event in writer.fail(f"the runtime failed: {exc}"):
                    yield _sse(event)
                return
            except DeadlinePassed as exc:  # the same, for a request past its timeout
                for event in writer.fail(str(exc)):
                    yield _sse(event)
                return
        for event in writer.finish(reason):
            yield _sse(event)

    return StreamingResponse(stream(), media_type="text/event-stream")
