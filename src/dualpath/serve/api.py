"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (SSE or whole; tools,
structured output, ``n`` samples, log-probabilities), the Responses API (``serve/responses.py``),
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dualpath.runtime.decoding import TokenLogprob
from dualpath.serve.backend import Backend, BackendFailure, GenerateRequest, TokenEvent
from dualpath.serve.body import BodyError, decode_object, read_limited
from dualpath.serve.chat import (
    ChatPlan,
    ReplyReader,
    chat_logprobs,
    completion_logprobs,
    plan_chat,
)
from dualpath.serve.metrics import ServeMetrics
from dualpath.serve.responses import create_response
from dualpath.serve.schema import (
    MAX_SEED,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    describe,
    error_body,
    unsupported_fields,
)
from dualpath.serve.tools import ToolCall


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """``api_keys`` maps each accepted key to its tenant (empty: no key needed);
    ``metrics_open``: ``/metrics`` needs no key even when there are keys; ``tool_format``:
    how tool calls are written in the model's text (``tools.TOOL_FORMATS``)."""

    api_keys: dict[str, str] = field(default_factory=dict)
    metrics_open: bool = False
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    max_stop_strings: int = 64
    tool_format: str = "hermes"


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run ``work``; cancel it if the client disconnects first (its ``finally`` frees the
    request). Returns whether it finished."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
    task.result()  # re-raise its error, if any
    return True


@dataclass(slots=True)
class _Timing:
    arrived: float
    first: float | None = None
    last: float | None = None


def usage(lasts: list[TokenEvent | None]) -> dict[str, Any]:
    """Chat / completions usage of the choices whose last events are ``lasts``."""
    seen = [e for e in lasts if e is not None]
    p = seen[0].num_prompt_tokens if seen else 0
    c = sum(e.num_generated_tokens for e in seen)
    cached = seen[0].num_cached_tokens if seen else 0
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Service:
    """What every generating route shares: the caller's key, the body, the
    ``GenerateRequest``, and the backend's token stream (timed, and counted in the metrics
    when it ends, however it ends)."""

    def __init__(self, backend: Backend, opts: ApiOptions, metrics: ServeMetrics) -> None:
        self.backend, self.opts, self.metrics = backend, opts, metrics

    def authorise(self, request: Request) -> str:
        """The caller's tenant ('' without API keys); 401 for a missing or unknown key."""
        if not self.opts.api_keys:
            return ""
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if key not in self.opts.api_keys:
            raise ApiError(401, "invalid or missing API key")
        return self.opts.api_keys[key]

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        length = request.headers.get("content-length")
        try:
            raw = await read_limited(request.stream(), length, self.opts.max_body_bytes)
            data = decode_object(raw)
        except BodyError as exc:
            raise ApiError(exc.status, exc.message, exc.param) from None
        except ClientDisconnect:
            raise ApiError(400, "the client went away before sending the whole body") from None
        unknown = unsupported_fields(data, model)
        if unknown is not None:
            raise ApiError(400, f"{unknown}: not supported by this server", unknown)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = describe(exc)
            raise ApiError(400, message, param) from None

    def to_request(self, body: Sampling, prompt: list[int], request: Request, grammar: str = "",
                   logprobs: int | None = None, prompt_param: str = "") -> GenerateRequest:  # fmt: skip
        """``prompt_param``: the field a too-long prompt is blamed on (default: messages for a
        chat request, else prompt)."""
        backend, opts = self.backend, self.opts
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
                prompt_param or ("messages" if isinstance(body, ChatRequest) else "prompt"),
            )
        bias: list[tuple[int, float]] = []
        for key, value in sorted((body.logit_bias or {}).items()):
            if not key.isdigit() or int(key) >= backend.vocab_size:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model",
                               "logit_bias")  # fmt: skip
            if not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias: {value} for {key} is outside [-100, 100]",
                               "logit_bias")  # fmt: skip
            bias.append((int(key), float(value)))
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_tokens=tuple(prompt),
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
            session_id=request.headers.get("x-session-id") or body.user,
            tenant=self.authorise(request),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=tuple(bias),
            logprobs=logprobs,
            grammar=grammar,
        )

    @staticmethod
    def samples(gen: GenerateRequest, n: int) -> list[GenerateRequest]:
        """``n`` parallel samples of one request: seeds ``seed + i`` when a seed is given."""
        out = [gen]
        for i in range(1, n):
            seed = None if gen.seed is None else (gen.seed + i) % (MAX_SEED + 1)
            out.append(replace(gen, request_id=f"{gen.request_id}-{i}", seed=seed))
        return out

    def check_alive(self) -> None:
        failure = self.backend.failure()
        if failure is not None:
            raise ApiError(503, f"the runtime failed: {failure}")

    async def tokens(self, gens: list[GenerateRequest],
                     arrived: float) -> AsyncGenerator[tuple[int, TokenEvent], None]:  # fmt: skip
        """``(choice, event)`` of every ``gens[choice]`` as they come, until all have ended;
        raises the backend's failure. Closing it early (use ``contextlib.aclosing``) frees
        the requests; either way each is counted in the metrics once."""
        t = _Timing(arrived)
        lasts: list[TokenEvent | None] = [None] * len(gens)
        out: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            events = self.backend.generate(gens[i])
            try:
                async for ev in events:
                    await out.put((i, ev))
                await out.put((i, None))
            except BaseException as exc:
                await out.put((i, exc))
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens))]
        try:
            running = len(gens)
            while running:
                i, item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    running -= 1
                    continue
                now = time.monotonic()
                t.first, t.last = t.first or now, now
                lasts[i] = item
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for last in lasts:
                self._observe(t, last)  # also when the client went away (finished_reason abort)

    async def whole(self, request: Request, gens: list[GenerateRequest], arrived: float,
                    on_event: Callable[[int, TokenEvent], None]) -> list[TokenEvent] | None:  # fmt: skip
        """Run ``gens`` to their end, ``on_event`` for each event; their last events, or None
        when the client went away first (the requests are then freed). A backend failure or
        an aborted request is a 503."""
        lasts: list[TokenEvent | None] = [None] * len(gens)

        async def drain() -> None:
            async with contextlib.aclosing(self.tokens(gens, arrived)) as events:
                try:
                    async for i, ev in events:
                        on_event(i, ev)
                        lasts[i] = ev
                except BackendFailure as exc:
                    raise ApiError(503, f"the runtime failed: {exc}") from None

        if not await _unless_disconnected(request, drain()):
            return None
        done = [last for last in lasts if last is not None and last.finish_reason != "abort"]
        if len(done) != len(gens):
            raise ApiError(503, "the request was aborted (server shutting down)")
        return done

    def _observe(self, t: _Timing, last: TokenEvent | None) -> None:
        if last is None:
            return
        m = self.metrics
        m.e2e.observe(time.monotonic() - t.arrived)
        if t.first is not None:
            m.ttft.observe(t.first - t.arrived)
            if last.num_generated_tokens > 1 and t.last is not None:
                m.tpot.observe((t.last - t.first) / (last.num_generated_tokens - 1))
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.generation_tokens.inc(last.num_generated_tokens)
        m.request_success.labels(finished_reason=last.finish_reason or "abort").inc()


async def _choices(svc: Service, request: Request, gens: list[GenerateRequest],
                   plan: ChatPlan | None, body: Sampling, arrived: float) -> Response:  # fmt: skip
    """Serve ``gens`` (one per choice) as one chat / text completion: whole, or as SSE."""
    svc.check_alive()
    chat = plan is not None
    rid = ("chatcmpl-" if chat else "cmpl-") + gens[0].request_id
    created = int(time.time())
    want_lp = gens[0].logprobs is not None
    tok = svc.backend.tokenizer

    def header(obj: str) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": svc.backend.model_name}

    if not body.stream:
        readers = [ReplyReader(plan.parse if plan else None) for _ in gens]
        lps: list[list[TokenLogprob]] = [[] for _ in gens]

        def on_event(i: int, ev: TokenEvent) -> None:
            readers[i].feed(ev.text)
            lps[i].extend(ev.logprobs)

        lasts = await svc.whole(request, gens, arrived, on_event)
        if lasts is None:
            return Response(status_code=499)  # nobody is listening any more
        choices = []
        for i, (reader, last) in enumerate(zip(readers, lasts, strict=True)):
            reader.finish()
            reason = reader.finish_reason(last.finish_reason)
            text = "".join(reader.content)
            if not chat:
                lp = completion_logprobs(tok, lps[i]) if want_lp else None
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": reason})  # fmt: skip
                continue
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if reader.calls:
                message["tool_calls"] = [c.openai() for c in reader.calls]
            else:
                message["content"] = text
            lp = chat_logprobs(tok, lps[i]) if want_lp else None
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": reason})  # fmt: skip
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**header(obj), "choices": choices, "usage": usage(list(lasts))})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def sse(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
        payload = {**header(chunk_obj), "choices": choices, **(extra or {})}
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(i: int, text: str, calls: list[ToolCall], first_call: int,
              lp: list[TokenLogprob], finish: str | None) -> dict[str, Any]:  # fmt: skip
        if not chat:
            logprobs = completion_logprobs(tok, lp) if want_lp else None
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [c.openai(first_call + k) for k, c in enumerate(calls)]
        logprobs = chat_logprobs(tok, lp) if want_lp and lp else None
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def stream() -> AsyncIterator[str]:
        lasts: list[TokenEvent | None] = [None] * len(gens)
        readers = [ReplyReader(plan.parse if plan else None) for _ in gens]
        async with contextlib.aclosing(svc.tokens(gens, arrived)) as events:
            if chat:
                for i in range(len(gens)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    yield sse([{**first, "logprobs": None, "finish_reason": None}])
            try:
                async for i, item in events:
                    reader = readers[i]
                    lasts[i] = item
                    before = len(reader.calls)
                    text, calls = reader.feed(item.text)
                    if item.finish_reason:
                        tail, more = reader.finish()
                        text, calls = text + tail, calls + more
                    finish = reader.finish_reason(item.finish_reason)
                    if text or calls or finish or (want_lp and item.logprobs):
                        yield sse([chunk(i, text, calls, before, list(item.logprobs), finish)])
            except BackendFailure as exc:  # an OpenAI error event, then the end
                err = error_body(503, f"the runtime failed: {exc}", None)
                yield f"data: {json.dumps(err)}\n\n"
                return
        if include_usage:
            yield sse([], {"usage": usage(lasts)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


def create_app(backend: Backend, options: ApiOptions | None = None) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the backend."""
    opts = options or ApiOptions()
    metrics = ServeMetrics(backend.stats)
    svc = Service(backend, opts, metrics)

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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and wrong methods, in OpenAI's error shape."""
        metrics.request_errors.labels(status=str(exc.status_code)).inc()
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} on this server"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), exc.status_code,
                            headers=getattr(exc, "headers", None))  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
        svc.authorise(request)
        body: ChatRequest = await svc.parse(request, ChatRequest)
        plan = plan_chat(body, backend.tokenizer, opts.tool_format, backend.supports_grammar)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        gen = svc.to_request(body, plan.prompt, request, plan.grammar, logprobs)
        return await _choices(svc, request, svc.samples(gen, body.n), plan, body, arrived)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()
        svc.authorise(request)
        body: CompletionRequest = await svc.parse(request, CompletionRequest)
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
        gen = svc.to_request(body, prompt, request, "", body.logprobs)
        return await _choices(svc, request, svc.samples(gen, body.n), None, body, arrived)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(svc, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        svc.authorise(request)
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
            svc.authorise(request)  # the counters are global: they would leak across tenants
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
