"""The DualPath router: an OpenAI API in front of vLLM prefill and decode instances.

Clients talk to it as to vLLM (``/v1/chat/completions`` and ``/v1/completions``, whole or SSE,
tools passed through; ``/v1/models``, ``/health``); each request goes through
``flow.TurnFlow``: tokens, the policy's PE / DE / read side, the storage read, the prefill
(``max_tokens`` 1) and the decode, whose answer is the client's, byte for byte as vLLM sent
it. ``/metrics`` adds the DualPath counters in ``dualpath serve``'s names (bytes per
``KVPath``, reads per side, SNIC busy seconds per node); ``/v1/dualpath/decisions`` is the
policy's decision trace. A field the router cannot honour (``n`` > 1, a client's own
``kv_transfer_params``) is a 400 naming it; an instance or side-car that fails is a 503.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dualpath.integrations.vllm.flow import FlowError, Prepared, TurnFlow
from dualpath.serve.schema import error_body
from dualpath.types import KVPath

# sampling-length and streaming fields the prefill does not take from the client
_PREFILL_DROP = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "logprobs",
                 "top_logprobs", "prompt_logprobs")  # fmt: skip
_TOKENIZE_CHAT = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                  "chat_template", "chat_template_kwargs", "add_special_tokens")  # fmt: skip


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


class _FlowCollector(Collector):
    def __init__(self, flow: TurnFlow) -> None:
        self._flow = flow

    def collect(self) -> Iterator[Metric]:
        st = self._flow.stats
        kv = CounterMetricFamily("dualpath:kv_bytes", "KV bytes moved per load path",
                                 labels=["path"])  # fmt: skip
        nodes = self._flow.node_stats()
        by_path = dict(st.bytes_by_path)
        de_written = sum(n.get("bytes_written", 0) for n in nodes if n.get("kind") == "de")
        stored = KVPath.DE_TO_STORAGE.value
        by_path[stored] = by_path.get(stored, 0.0) + de_written
        for path, nbytes in sorted(by_path.items()):
            kv.add_metric([path], nbytes)
        yield kv
        side = CounterMetricFamily("dualpath:reads", "Storage reads per read side",
                                   labels=["side"])  # fmt: skip
        for name in ("pe", "de"):
            side.add_metric([name], st.reads_by_side.get(name, 0))
        yield side
        yield CounterMetricFamily(
            "dualpath:prefix_cache_queries",
            "Prompt tokens looked up in the store",
            value=st.prompt_tokens,
        )
        yield CounterMetricFamily("dualpath:prefix_cache_hits", "Prompt tokens loaded from the store",
                                  value=st.hit_tokens)  # fmt: skip
        yield CounterMetricFamily("dualpath:requests_done", "Requests answered", value=st.num_done)
        yield CounterMetricFamily("dualpath:requests_failed", "Requests that ended in an error",
                                  value=st.num_failed)  # fmt: skip
        busy = GaugeMetricFamily("dualpath:snic_busy_seconds", "Emulated SNIC busy time",
                                 labels=["node", "direction"])  # fmt: skip
        for n in nodes:
            if n.get("down"):
                continue
            busy.add_metric([str(n["node"]), "read"], n["read_busy_s"])
            busy.add_metric([str(n["node"]), "write"], n["write_busy_s"])
        yield busy
        stage = CounterMetricFamily("dualpath:router_stage_seconds",
                                    "Seconds requests spent in each stage of the router",
                                    labels=["stage"])  # fmt: skip
        for name, seconds in sorted(st.stage_s.items()):
            stage.add_metric([name], seconds)
        yield stage


class Router:
    """Routes OpenAI requests through a ``TurnFlow`` to the deployment's instances."""

    def __init__(self, flow: TurnFlow, request_timeout_s: float = 300.0,
                 default_max_tokens: int = 256) -> None:  # fmt: skip
        self.flow = flow
        self.dep = flow.dep
        self.default_max_tokens = default_max_tokens
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0))

    def _url(self, engine: int, path: str) -> str:
        return self.dep.instance(self.flow.topology.node_of(engine)).url + path

    async def tokens(self, kind: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as vLLM makes them (the first prefill's ``/tokenize``)."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
                return list(prompt)
            if not isinstance(prompt, str):
                raise FlowError(400, "prompt: must be a string or a list of token ids (one "
                                     "prompt per request through the DualPath router)")  # fmt: skip
            req: dict[str, Any] = {"model": self.dep.model, "prompt": prompt}
            if "add_special_tokens" in body:
                req["add_special_tokens"] = body["add_special_tokens"]
        else:
            req = {"model": self.dep.model, **{k: body[k] for k in _TOKENIZE_CHAT if k in body}}
        r = await self._tokenize(req)
        if r.status_code != 200:
            raise FlowError(r.status_code, _message(r))
        tokens = r.json().get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise FlowError(400, "the prompt is empty")
        return tokens

    async def _tokenize(self, req: dict[str, Any]) -> httpx.Response:
        """``/tokenize`` on the first instance that answers (prefill instances first)."""
        last: Exception | None = None
        for inst in sorted(self.dep.instances, key=lambda i: (i.kind != "pe", i.node)):
            try:
                return await self.client.post(inst.url + "/tokenize", json=req)
            except httpx.HTTPError as err:
                last = err
        raise FlowError(503, f"no vLLM instance answers /tokenize: {last}")

    async def serve(self, kind: str, path: str, body: Any, tenant: str = "") -> Response:
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        for field, ok in (("n", body.get("n", 1) in (1, None)),
                          ("kv_transfer_params", body.get("kv_transfer_params") is None)):  # fmt: skip
            if not ok:
                return _error(400, f"{field}: not supported through the DualPath router "
                                   f"(got {body.get(field)!r})", field)  # fmt: skip
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = limit if isinstance(limit, int) and limit > 0 else self.default_max_tokens
        stage = self.flow.stats.time_stage
        try:
            with stage("tokenize"):
                tokens = await self.tokens(kind, body)
            with stage("place_and_read"):
                prep = await self.flow.place(tokens, max_tokens, tenant)
        except FlowError as err:
            return _error(err.status, err.message)
        try:
            with stage("prefill"):
                failed = await self._prefill(kind, path, body, prep)
        except BaseException:
            self.flow.release(prep)
            raise
        if failed is not None:
            self.flow.release(prep)
            return failed
        dbody = dict(body, kv_transfer_params=self.flow.decode_params(prep, tenant))
        if body.get("stream"):
            return await self._stream(path, dbody, prep)
        return await self._whole(path, dbody, prep)

    async def _prefill(self, kind: str, path: str, body: dict[str, Any],
                       prep: Prepared) -> Response | None:  # fmt: skip
        pbody = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
        pbody["max_tokens"] = 1
        pbody["kv_transfer_params"] = self.flow.prefill_params(prep)
        self.flow.prefilling(prep)
        try:
            r = await self.client.post(self._url(prep.assign.pe, path), json=pbody)
        except httpx.HTTPError as err:
            return _error(503, f"prefill instance failed: {type(err).__name__}: {err}")
        if r.status_code != 200:
            return Response(r.content, r.status_code, media_type="application/json")
        self.flow.prefilled(prep)
        return None

    async def _whole(self, path: str, dbody: dict[str, Any], prep: Prepared) -> Response:
        try:
            with self.flow.stats.time_stage("decode"):
                r = await self.client.post(self._url(prep.assign.de, path), json=dbody)
        except httpx.HTTPError as err:
            self.flow.release(prep)
            return _error(503, f"decode instance failed: {type(err).__name__}: {err}")
        if r.status_code != 200:
            self.flow.release(prep)
            return Response(r.content, r.status_code, media_type="application/json")
        self.flow.decoding(prep)
        self.flow.finish(prep)
        return Response(r.content, 200, media_type="application/json")

    async def _stream(self, path: str, dbody: dict[str, Any], prep: Prepared) -> Response:
        req = self.client.build_request("POST", self._url(prep.assign.de, path), json=dbody)
        try:
            with self.flow.stats.time_stage("decode_first_byte"):
                r = await self.client.send(req, stream=True)
        except httpx.HTTPError as err:
            self.flow.release(prep)
            return _error(503, f"decode instance failed: {type(err).__name__}: {err}")
        if r.status_code != 200:
            content = await r.aread()
            await r.aclose()
            self.flow.release(prep)
            return Response(content, r.status_code, media_type="application/json")
        self.flow.decoding(prep)

        async def relay() -> AsyncIterator[bytes]:
            done = False  # the turn is counted finished before the client sees its end
            try:
                async for chunk in r.aiter_raw():
                    if not done and b"data: [DONE]" in chunk:
                        done = True
                        self.flow.finish(prep)
                    yield chunk
                if not done:
                    done = True
                    self.flow.finish(prep)
            except httpx.HTTPError as err:  # the decode died mid-answer: a clean error event
                event = error_body(503, f"decode instance failed: {type(err).__name__}")
                yield f"data: {json.dumps(event)}\n\n".encode()
            finally:
                await r.aclose()
                if not done:
                    self.flow.abort(prep.turn)

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def close(self) -> None:
        await self.client.aclose()


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error", {})
        return str(err.get("message") if isinstance(err, dict) else err) or r.text
    except (ValueError, AttributeError):
        return r.text[:200]


def create_app(router: Router) -> FastAPI:
    registry = CollectorRegistry()
    registry.register(_FlowCollector(router.flow))
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.close()

    app = FastAPI(title="dualpath router (vLLM)", lifespan=lifespan)

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            return None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.serve("chat", "/v1/chat/completions", await body_of(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.serve("completions", "/v1/completions", await body_of(request))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": router.dep.model, "object": "model", "created": int(started),
             "owned_by": "dualpath"}]})  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dualpath/decisions")
    async def decisions() -> Response:
        records = router.flow.policy.decisions()
        note = "" if router.flow.policy.params.record_decisions else (
            "off: start with --set scheduler.record_decisions=true")  # fmt: skip
        return JSONResponse({"decisions": records, "note": note})

    return app
