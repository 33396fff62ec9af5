"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (SSE or whole),
models, health and Prometheus metrics. Bad input (body size, depth, Unicode, ranges: see
``serve/body.py``) is a 4xx in OpenAI's error shape, never a 500; a client that goes away
closes its backend iterator, which frees the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from dualpath.serve.backend import Backend, BackendFailure, GenerateRequest, TokenEvent
from dualpath.serve.body import BodyError, decode_object, read_limited
from dualpath.serve.metrics import ServeMetrics


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """``api_keys`` maps each accepted key to its tenant (empty: no key needed);
    ``metrics_open``: ``/metrics`` needs no key even when there are keys;
    ``request_timeout_s``: every generation request ends this long after it arrived at the
    latest (queueing included), with a 504 or, in a stream, an error event."""

    api_keys: dict[str, str] = field(default_factory=dict)
    metrics_open: bool = False
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    max_stop_strings: int = 4
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} is invalid: must be > 0")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class ContentPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


MAX_TOKENS = 2**31 - 1  # far past any context length: a bigger value is named as the error
MAX_SEED = 2**63 - 1  # a seed is a non-negative int64 (what torch generators take)


class _Sampling(_Base):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # an extension (as vLLM's): each choice's output token ids
    logprobs: bool | int | None = None
    echo: bool = False

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.echo:
            return "echo"
        return None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {
        401: "authentication_error", 404: "not_found_error", 503: "server_error",
        504: "timeout_error",
    }  # fmt: skip
    return {
        "error": {
            "message": message,
            "type": kind.get(status, "invalid_request_error"),
            "param": param,
            "code": None,
        }
    }


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    return f"{loc}: {first['msg']}" if loc else str(first["msg"]), loc or None


class DeadlinePassed(Exception):
    """A request reached its ``request_timeout_s`` (its backend request is cancelled)."""


async def _unless_disconnected(request: Request, work: Awaitable[None], deadline: float) -> bool:
    """Run ``work``; cancel it if the client disconnects first (its ``finally`` frees the
    request), or ``DeadlinePassed`` once ``time.monotonic()`` reaches ``deadline``. Returns
    whether it finished."""
    task = asyncio.ensure_future(work)
    while not task.done():
        left = deadline - time.monotonic()
        await asyncio.wait({task}, timeout=max(0.0, min(DISCONNECT_POLL_S, left)))
        if task.done():
            break
        timed_out = time.monotonic() >= deadline
        if timed_out or await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if timed_out:
                raise DeadlinePassed
            return False
    task.result()  # re-raise its error, if any
    return True


async def _next_before(events: AsyncIterator[TokenEvent], deadline: float) -> TokenEvent:
    """The stream's next event; ``StopAsyncIteration`` at its end, ``DeadlinePassed`` (the
    pending step cancelled, which ends the generator and frees its request) at ``deadline``."""
    try:
        return await asyncio.wait_for(anext(events), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise DeadlinePassed from None


@dataclass(slots=True)
class _Timing:
    arrived: float
    first: float | None = None
    last: float | None = None


def create_app(backend: Backend, options: ApiOptions | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the backend."""
    opts = options or ApiOptions()
    metrics = ServeMetrics(backend.stats)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="dualpath serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status)).inc()
        return JSONResponse(error_body(exc.status, exc.message, exc.param), exc.status)

    def authorise(request: Request) -> str:
        """The caller's tenant ('' without API keys); 401 for a missing or unknown key."""
        if not opts.api_keys:
            return ""
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if key not in opts.api_keys:
            raise ApiError(401, "invalid or missing API key")
        return opts.api_keys[key]

    async def parse(request: Request, model: type[_Sampling]) -> Any:
        length = request.headers.get("content-length")
        try:
            raw = await read_limited(request.stream(), length, opts.max_body_bytes)
            data = decode_object(raw)
        except BodyError as exc:
            raise ApiError(exc.status, exc.message, exc.param) from None
        except ClientDisconnect:
            raise ApiError(400, "the client went away before sending the whole body") from None
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = _describe(exc)
            raise ApiError(400, message, param) from None

    def to_request(body: _Sampling, prompt: list[int], request: Request) -> GenerateRequest:
        if (name := body.unsupported()) is not None:
            raise ApiError(400, f"{name}: not supported by this server", name)
        if body.model not in (None, backend.model_name):
            raise ApiError(404, f"model {body.model!r} does not exist", "model")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > opts.max_stop_strings:
            raise ApiError(400, f"stop: at most {opts.max_stop_strings} strings", "stop")
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        max_tokens = body.max_completion_tokens or body.max_tokens or opts.default_max_tokens
        limit = backend.max_context_tokens
        if len(prompt) + max_tokens > limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens; the request has "
                f"{len(prompt)} prompt tokens and max_tokens={max_tokens}",
                "messages" if isinstance(body, ChatRequest) else "prompt",
            )
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_tokens=tuple(prompt),
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
            session_id=request.headers.get("x-session-id") or body.user,
            tenant=authorise(request),
        )

    def usage(last: TokenEvent | None) -> dict[str, Any]:
        p = last.num_prompt_tokens if last else 0
        c = last.num_generated_tokens if last else 0
        cached = last.num_cached_tokens if last else 0
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def observe(t: _Timing, last: TokenEvent | None) -> None:
        if last is None:
            return
        now = time.monotonic()
        metrics.e2e.observe(now - t.arrived)
        if t.first is not None:
            metrics.ttft.observe(t.first - t.arrived)
            if last.num_generated_tokens > 1 and t.last is not None:
                metrics.tpot.observe((t.last - t.first) / (last.num_generated_tokens - 1))
        metrics.prompt_tokens.inc(last.num_prompt_tokens)
        metrics.generation_tokens.inc(last.num_generated_tokens)
        metrics.request_success.labels(finished_reason=last.finish_reason or "abort").inc()

    async def run(
        request: Request, gen: GenerateRequest, chat: bool, body: _Sampling, t: _Timing
    ) -> Response:
        failure = backend.failure()
        if failure is not None:
            raise ApiError(503, f"the runtime failed: {failure}")
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        created = int(time.time())
        deadline = t.arrived + opts.request_timeout_s
        timeout_text = (
            f"the request did not finish within request_timeout_s={opts.request_timeout_s:g} s"
        )
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, stream: bool, ids: list[int]) -> dict[str, Any]:
            # ``return_token_ids`` (as vLLM): the output's token ids, new ones in each chunk
            extra = {"token_ids": ids} if body.return_token_ids else {}
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                        **extra}  # fmt: skip
            key = "delta" if stream else "message"
            content: dict[str, Any] = (
                {"content": text}
                if stream
                else {
                    "role": "assistant",
                    "content": text,
                }
            )
            return {"index": 0, key: content, "logprobs": None, "finish_reason": finish, **extra}

        if not body.stream:
            parts: list[str] = []
            ids: list[int] = []
            last: TokenEvent | None = None

            async def collect() -> None:
                nonlocal last
                events = backend.generate(gen)
                try:
                    async for ev in events:
                        t.first = t.first or time.monotonic()
                        t.last = time.monotonic()
                        parts.append(ev.text)
                        ids.extend(ev.token_ids)
                        last = ev
                except BackendFailure as exc:
                    raise ApiError(503, f"the runtime failed: {exc}") from None
                finally:
                    await events.aclose()  # type: ignore[attr-defined]

            try:
                finished = await _unless_disconnected(request, collect(), deadline)
            except DeadlinePassed:
                metrics.request_timeouts.inc()
                raise ApiError(504, timeout_text) from None
            observe(t, last)
            if not finished:
                return Response(status_code=499)  # nobody is listening any more
            if last is None or last.finish_reason == "abort":
                raise ApiError(503, "the request was aborted (server shutting down)")
            return JSONResponse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": backend.model_name,
                    "choices": [choice("".join(parts), last.finish_reason, False, ids)],
                    "usage": usage(last),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
            payload = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": backend.model_name,
                "choices": choices,
                **(extra or {}),
            }
            return f"data: {json.dumps(payload)}\n\n"

        async def stream() -> AsyncIterator[str]:
            last: TokenEvent | None = None
            events = backend.generate(gen)
            try:
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                    yield sse([{**first, "logprobs": None, "finish_reason": None}])
                try:
                    while True:
                        try:
                            ev = await _next_before(events, deadline)
                        except StopAsyncIteration:
                            break
                        t.first = t.first or time.monotonic()
                        t.last = time.monotonic()
                        last = ev
                        if ev.text or ev.finish_reason or (body.return_token_ids and ev.token_ids):
                            yield sse([choice(ev.text, ev.finish_reason, True, [*ev.token_ids])])
                except BackendFailure as exc:  # an OpenAI error event, then the stream ends
                    err = error_body(503, f"the runtime failed: {exc}", None)
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                except DeadlinePassed:  # the same, for a request past its timeout
                    metrics.request_timeouts.inc()
                    yield f"data: {json.dumps(error_body(504, timeout_text, None))}\n\n"
                    return
                if include_usage:
                    yield sse([], {"usage": usage(last)})
                yield "data: [DONE]\n\n"
            finally:
                observe(t, last)  # also when the client went away (finished_reason abort)
                await events.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t = _Timing(time.monotonic())
        authorise(request)
        body: ChatRequest = await parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = backend.tokenizer.render_chat(messages)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
        prompt = backend.tokenizer.encode(text)
        return await run(request, to_request(body, prompt, request), True, body, t)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t = _Timing(time.monotonic())
        authorise(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, "prompt: only one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, str):
            prompt = backend.tokenizer.encode(p)
        else:
            prompt = [int(x) for x in p]
            if any(x < 0 or x >= backend.vocab_size for x in prompt):
                raise ApiError(400, "prompt: token id out of the vocabulary", "prompt")
        return await run(request, to_request(body, prompt, request), False, body, t)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorise(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dualpath",
                    "max_model_len": backend.max_context_tokens,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        failure = backend.failure()
        if failure is not None:  # the runtime died: the server is on its way out (fail-fast)
            return JSONResponse({"status": "error", "error": failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if not opts.metrics_open:
            authorise(request)  # the counters are global: they would leak across tenants
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
