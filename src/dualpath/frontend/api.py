"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (SSE or whole; tools,
structured output, ``n`` samples, log-probabilities), the Responses API (``frontend/responses.py``),
models, health and Prometheus metrics. Bad input (body size, depth, Unicode, ranges: see
``frontend/body.py``) is a 4xx in OpenAI's error shape, never a 500; a client that goes away
closes its backend iterator, which frees the request.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dualpath.frontend.backend import Backend, BackendFailure, GenerateRequest, TokenEvent
from dualpath.frontend.chat import (
    ChatPlan,
    ReplyPiece,
    ReplyReader,
    chat_logprobs,
    completion_logprobs,
    plan_chat,
)
from dualpath.frontend.grammars import GrammarCollector
from dualpath.frontend.metrics import ServeMetrics
from dualpath.frontend.responses import create_response
from dualpath.frontend.schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    error_body,
)
from dualpath.frontend.service import ApiOptions, DeadlinePassed, Service, usage
from dualpath.metrics.hops import hop
from dualpath.tokens import TokenLogprob


async def _choices(
    svc: Service,
    request: Request,
    gens: list[GenerateRequest],
    plan: ChatPlan | None,
    body: Sampling,
    arrived: float,
) -> Response:
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
        readers = [plan.reader() if plan else ReplyReader(None) for _ in gens]
        lps: list[list[TokenLogprob]] = [[] for _ in gens]
        ids: list[list[int]] = [[] for _ in gens]

        def on_event(i: int, ev: TokenEvent) -> None:
            readers[i].feed(ev.text)
            lps[i].extend(ev.logprobs)
            ids[i].extend(ev.token_ids)

        lasts = await svc.whole(request, gens, arrived, on_event)
        if lasts is None:
            return Response(status_code=499)  # nobody is listening any more
        choices = []
        for i, (reader, last) in enumerate(zip(readers, lasts, strict=True)):
            reader.feed("", final=True)
            reason = reader.finish_reason(last.finish_reason)
            text = "".join(reader.content)
            extra = {"token_ids": ids[i]} if body.return_token_ids else {}
            if not chat:
                lp = completion_logprobs(tok, lps[i]) if want_lp else None
                choices.append(
                    {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, **extra}
                )
                continue
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if reader.thinker is not None:  # (as vLLM: null when the reply did not think)
                message["reasoning_content"] = "".join(reader.reasoning) or None
            if reader.calls:
                message["tool_calls"] = [c.openai() for c in reader.calls]
            else:
                message["content"] = text
            lp = chat_logprobs(tok, lps[i]) if want_lp else None
            choices.append(
                {"index": i, "message": message, "logprobs": lp, "finish_reason": reason, **extra}
            )
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**header(obj), "choices": choices, "usage": usage(list(lasts))})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def sse(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
        payload = {**header(chunk_obj), "choices": choices, **(extra or {})}
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(i: int, piece: ReplyPiece, ev: TokenEvent, finish: str | None) -> dict[str, Any]:
        text, calls = piece.content, piece.deltas
        lp = list(ev.logprobs)
        # ``return_token_ids`` (as vLLM): the new output token ids in each chunk
        extra = {"token_ids": list(ev.token_ids)} if body.return_token_ids else {}
        if not chat:
            logprobs = completion_logprobs(tok, lp) if want_lp else None
            return {
                "index": i,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
                **extra,
            }
        delta: dict[str, Any] = {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [c.openai() for c in calls]
        logprobs = chat_logprobs(tok, lp) if want_lp and lp else None
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}

    async def stream() -> AsyncIterator[str]:
        lasts: list[TokenEvent | None] = [None] * len(gens)
        readers = [plan.reader() if plan else ReplyReader(None) for _ in gens]
        async with contextlib.aclosing(svc.tokens(gens, arrived)) as events:
            if chat:
                for i in range(len(gens)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    yield sse([{**first, "logprobs": None, "finish_reason": None}])
            try:
                async for i, item in events:
                    reader = readers[i]
                    lasts[i] = item
                    piece = reader.feed(item.text, final=bool(item.finish_reason))
                    finish = reader.finish_reason(item.finish_reason)
                    news = (want_lp and item.logprobs) or (body.return_token_ids and item.token_ids)
                    if piece.content or piece.reasoning or piece.deltas or finish or news:
                        hop("http.sse")
                        yield sse([chunk(i, piece, item, finish)])
            except BackendFailure as exc:  # an OpenAI error event, then the end
                err = error_body(503, f"the runtime failed: {exc}", None)
                yield f"data: {json.dumps(err)}\n\n"
                return
            except DeadlinePassed as exc:  # the same, for a request past its timeout
                yield f"data: {json.dumps(error_body(504, str(exc), None))}\n\n"
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
            svc.grammars.close()
            await backend.stop()

    app = FastAPI(title="dualpath serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics  # the HTTP server adds its connection counters
    metrics.registry.register(GrammarCollector(svc.grammars))

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
        return JSONResponse(
            error_body(exc.status_code, message),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
        hop("http.request")
        svc.authorise(request)
        body: ChatRequest = await svc.parse(request, ChatRequest)
        plan = plan_chat(
            body,
            backend.tokenizer,
            opts.tool_format,
            backend.supports_grammar,
            opts.grammar.max_bytes,
            opts.reasoning_parser,
        )
        await svc.check_grammar(plan)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")
        gen = svc.to_request(body, plan.prompt, request, plan.grammar, logprobs)
        if plan.needs_special_tokens:  # the tool format's markers are special tokens
            gen = replace(gen, skip_special_tokens=False)
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
        not_ready = backend.not_ready()
        if not_ready:  # recovering (a process being restarted): serving again soon
            return JSONResponse({"status": "recovering", "reason": not_ready}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if not opts.metrics_open:
            svc.authorise(request)  # the counters are global: they would leak across tenants
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
