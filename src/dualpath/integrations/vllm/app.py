"""The router's ASGI app (FastAPI): the OpenAI routes, ``/health``, ``/metrics`` and
``/v1/dualpath/decisions`` over a ``router.Router``, each behind the default engine's key
check (``frontend.service.tenant_of``) but ``/health``; vLLM's other routes passed to an instance
(``Router.forward``); its lifespan runs the background tasks (the supervisor, the event
loop's lag) and stops them; an access log line per request (``access.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dualpath.frontend.schema import ApiError
from dualpath.frontend.service import tenant_of
from dualpath.integrations.vllm.access import AccessLog, LoopLag
from dualpath.integrations.vllm.collector import FlowCollector, take_snapshot
from dualpath.integrations.vllm.router import Router, error_response
from dualpath.integrations.vllm.setup import READ_SIDES, READ_SIDES_ALLOWED
from dualpath.types import ReadSide

Background = Callable[[], Coroutine[Any, Any, None]]


def create_app(
    router: Router,
    background: Sequence[Background] = (),
    restarts: Mapping[str, int] | None = None,
    access_log: bool = True,
) -> FastAPI:
    """The router's ASGI app; ``background``: tasks run while it serves (the supervisor);
    ``restarts``: the supervisor's restarts per process, for ``/metrics``; ``access_log``:
    a line per request on stderr (``access.AccessLog``)."""
    registry = CollectorRegistry()
    collector = FlowCollector(router.flow, restarts)
    registry.register(collector)
    lag = LoopLag()
    registry.register(lag)
    keys = router.opts.api_keys

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(run()) for run in [lag.run, *background]]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await router.close()

    app = FastAPI(title="dualpath router (vLLM)", lifespan=lifespan, docs_url=None, redoc_url=None)
    if access_log:
        app.add_middleware(AccessLog)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            return None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        tenant = tenant_of(keys, request)
        body = await body_of(request)
        return await router.serve("chat", "/v1/chat/completions", body, tenant, request.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = tenant_of(keys, request)
        body = await body_of(request)
        return await router.serve("completions", "/v1/completions", body, tenant, request.headers)

    # vLLM's routes the DualPath flow has no part in: passed to an instance as they are
    # (open or behind the key as vLLM's own --api-key has them: only /v1 needs one)
    async def forwarded(request: Request, stateful: bool = False) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        content = await request.body()
        return await router.forward(request.method, path, content, request.headers, stateful)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        tenant_of(keys, request)
        return await forwarded(request)

    @app.post("/tokenize")
    @app.post("/detokenize")
    @app.get("/version")
    async def open_routes(request: Request) -> Response:
        return await forwarded(request)

    @app.post("/v1/responses")
    @app.get("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    async def responses(request: Request) -> Response:
        """The Responses API on the first decode instance, whose memory keeps the responses
        (``previous_response_id``): not through the DualPath flow."""
        tenant_of(keys, request)
        return await forwarded(request, stateful=True)

    @app.get("/health")
    async def health() -> Response:  # open, as the default engine's: a probe has no key
        if not router.is_ready:
            return JSONResponse(
                {"status": "not ready", "down": dict(sorted(router.down.items()))}, status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not router.opts.metrics_open:
            tenant_of(keys, request)  # the counters are global: they would leak across tenants
        collector.snapshot = await asyncio.to_thread(take_snapshot, router.flow)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dualpath/decisions")
    async def decisions(request: Request) -> Response:
        tenant_of(keys, request)
        records = router.flow.policy.decisions()
        note = (
            ""
            if router.flow.policy.params.record_decisions
            else ("off: start with --set scheduler.record_decisions=true")
        )
        return JSONResponse({"decisions": records, "note": note})

    @app.put("/v1/dualpath/read_side")
    async def read_side(request: Request) -> Response:
        """Force every storage read to one side from now on, or back to the policy's choice
        (``--read-side`` without a restart: diagnosis and tests)."""
        tenant_of(keys, request)
        body = await body_of(request)
        side = body.get("read_side") if isinstance(body, dict) else None
        if side not in READ_SIDES:
            return error_response(
                400, f"read_side={side!r} is invalid: {READ_SIDES_ALLOWED}", "read_side"
            )
        router.flow.read_side = None if side == "policy" else ReadSide(side)
        return JSONResponse({"read_side": side})

    return app
