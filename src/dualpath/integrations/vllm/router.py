"""The DualPath router: an OpenAI API in front of vLLM prefill and decode instances.

Clients talk to it as to vLLM (``/v1/chat/completions`` and ``/v1/completions``, whole or SSE,
tools passed through; the routes and the key check are ``app.py``'s); each request goes
through ``flow.TurnFlow``: tokens, the policy's PE / DE / read side, the storage read, the
prefill (``max_tokens`` 1) and the decode, whose answer is the client's as vLLM sent it but
for ``usage.prompt_tokens_details.cached_tokens``: the tokens the store served
(``relay.py``). The caller's tenant namespaces the request's KV.

A request lives in one ``request.Request`` from arrival to its one exit (``Request.close``),
which tells the core how the turn ended and gives back what it still holds, however it ends. Every wait is bounded by its deadline
(``request_timeout_s``: a 504 naming what it waited for, or an error event in a stream) and
ends at once when something it needs goes down (``lose``, from the supervisor: a 503 naming
it). A field the router cannot honour (a client's own ``kv_transfer_params``) or a prompt no
buffer can hold is a 400 naming it; an instance or side-car that fails is a 503 (errors in
vLLM's shape: ``vllm_error_body``). ``n`` > 1 runs the prefill once and lets the decode sample
the choices; a batched completion prompt runs each prompt through the flow and joins the
answers (``fanout.py``); vLLM's routes the flow has no part in are passed to an instance
(``forward``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response

from dualpath.integrations.vllm.fanout import StreamJoin, batch_prompts, join_whole
from dualpath.integrations.vllm.flow import FlowError, TurnFlow
from dualpath.integrations.vllm.relay import EventRelay, with_cached_tokens
from dualpath.integrations.vllm.request import Outcome, Request
from dualpath.integrations.vllm.setup import Instance
from dualpath.integrations.vllm.streams import Relay, joined, nothing

# sampling-length and streaming fields the prefill does not take from the client
_PREFILL_DROP = (
    "n",  # the prefill computes the prompt's KV once; the decode samples the n choices
    "stream",
    "stream_options",
    "min_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)
UPSTREAM_KEPT = 64  # idle connections to the instances kept
UPSTREAM_IDLE_S = 4.0  # and for how long: below vLLM's default keep-alive of 5 s (the
# instances we start keep theirs 75 s: setup.INSTANCE_KEEPALIVE_S)
# the client's headers passed on to the instances (the key check is the router's)
_PASSED_HEADERS = ("x-request-id",)
_FORWARDED_HEADERS = ("x-request-id", "content-type", "accept")
_TOKENIZE_CHAT = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "add_special_tokens",
)


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """``api_keys``: key → tenant (empty: no key needed); ``metrics_open``: ``/metrics`` needs
    no key even with keys; ``request_timeout_s``: every request ends this long after it arrived
    at the latest; ``default_max_tokens``: a request's ``max_tokens`` when it gives none."""

    api_keys: Mapping[str, str] = field(default_factory=dict)
    metrics_open: bool = False
    request_timeout_s: float = 300.0
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} is invalid: must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens={self.default_max_tokens} is invalid: must be >= 1"
            )


# vLLM's error ``type`` per status (``vllm.entrypoints.serve.exception_handling``); others:
# the status's phrase, as vLLM's ``GracefulHTTPError``
_VLLM_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def vllm_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM's OpenAI server writes it: its ``type`` and the status as ``code``."""
    kind = _VLLM_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(vllm_error_body(status, message, param), status_code=status)


def _sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(vllm_error_body(status, message))}\n\n".encode()


class _Answered(Exception):
    """An instance answered with an error: passed to the client as it is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class Router:
    """Routes OpenAI requests through a ``TurnFlow`` to the deployment's instances."""

    def __init__(
        self,
        flow: TurnFlow,
        options: RouterOptions | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``transport``: how the instances are reached (tests: in-process fake instances)."""
        self.flow = flow
        self.dep = flow.dep
        self.opts = options or RouterOptions()
        # a connection per request in flight (httpx's default caps them at 100: a burst
        # queued inside the pool), 64 kept for the next requests (httpcore scans every kept
        # one per request), each for less than vLLM keeps an idle one (uvicorn's 5 s,
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE): never sent on as the instance closes it (a ReadError)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.opts.request_timeout_s, connect=5.0),
            transport=transport,
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=UPSTREAM_KEPT,
                keepalive_expiry=UPSTREAM_IDLE_S,
            ),
        )
        self.down: dict[str, str] = {}  # process → why it is down (the supervisor's word)
        self._held: dict[int, Request] = {}

    # ------------------------------------------------------------ availability
    @property
    def is_ready(self) -> bool:
        return not self.down

    def lose(self, component: str, nodes: Sequence[int], reason: str) -> None:
        """``component`` (on ``nodes``) is down: requests that use them end now (503)."""
        self.down[component] = reason
        now = asyncio.get_running_loop().time()
        for held in list(self._held.values()):
            if held.ended or not held.uses(nodes):
                continue
            held.ended = reason
            if held.timer is not None:
                with contextlib.suppress(RuntimeError):  # already expiring
                    held.timer.reschedule(now)

    def restore(self, component: str) -> None:
        self.down.pop(component, None)

    def holds(self, node: int) -> bool:
        """Whether a request in the router may still touch node ``node``."""
        return any(h.uses([node]) for h in self._held.values())

    def _not_ready(self) -> str:
        return "the deployment is not ready: " + "; ".join(v for _, v in sorted(self.down.items()))

    # ------------------------------------------------------------ one request's life
    def _open(self, path: str, headers: dict[str, str]) -> Request:
        deadline = asyncio.get_running_loop().time() + self.opts.request_timeout_s
        held = Request(self.flow, self.flow.next_rid(), deadline, path, headers)
        self._held[held.rid] = held
        return held

    async def _close(self, held: Request) -> None:
        """The request leaves the router (once): aborted unless its answer went out
        (``Request.close``), its upstream stream closed."""
        if self._held.pop(held.rid, None) is None:
            return
        held.close(Outcome.ABORTED)
        if held.upstream is not None:
            with contextlib.suppress(httpx.HTTPError):
                await held.upstream.aclose()

    @asynccontextmanager
    async def _bounded(self, held: Request, what: str) -> AsyncIterator[None]:
        """A wait that ends by the request's deadline (504 naming ``what``) or as soon as a
        process it needs goes down (503 naming it)."""
        if held.ended:
            raise FlowError(503, held.ended)
        timer = asyncio.timeout_at(held.deadline)
        try:
            async with timer:
                held.timer = timer
                yield
        except TimeoutError:
            if not timer.expired():
                raise
            if held.ended:
                raise FlowError(503, held.ended) from None
            raise FlowError(
                504,
                f"the request did not finish within request_timeout_s="
                f"{self.opts.request_timeout_s:g} s (it waited for {what})",
            ) from None
        finally:
            held.timer = None

    def _url(self, engine: int, path: str) -> str:
        return self.dep.instance(self.flow.topology.node_of(engine)).url + path

    async def tokens(self, kind: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as vLLM makes them (the first prefill's ``/tokenize``)."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
                return list(prompt)
            if not isinstance(prompt, str):
                raise FlowError(
                    400,
                    "prompt: must be a string or a list of token ids (one "
                    "prompt per request through the DualPath router)",
                )
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

    async def serve(
        self,
        kind: str,
        path: str,
        body: Any,
        tenant: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """One OpenAI request through the flow; ``headers``: the client's to pass on to the
        instances (``x-request-id``: vLLM names the answer after it)."""
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            return error_response(
                400,
                "kv_transfer_params: not supported through the DualPath router (the router "
                "sets it)",
                "kv_transfer_params",
            )
        if self.down:
            return error_response(503, self._not_ready())
        passed = {k: v for k, v in (headers or {}).items() if k.lower() in _PASSED_HEADERS}
        prompts = batch_prompts(body) if kind == "completions" else None
        if prompts is not None:
            return await self._batch(path, body, prompts, tenant, passed)
        return await self._one(kind, path, body, tenant, passed)

    async def _one(
        self, kind: str, path: str, body: dict[str, Any], tenant: str, headers: dict[str, str]
    ) -> Response:
        held = self._open(path, headers)
        handed_over = False  # to the stream's response, which closes it
        try:
            await self._place(held, kind, body, tenant)
            await self._prefill(held, body)
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            n = body.get("n")
            choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
            params = held.decode_params(tenant, choices)
            dbody = dict(body, kv_transfer_params=params)
            if limit is None:  # (a bad one is the decode's to refuse, as vLLM's)
                dbody["max_tokens"] = self.opts.default_max_tokens
            if body.get("stream"):
                response = await self._stream(held, dbody)
                handed_over = True
                return response
            return await self._whole(held, dbody)
        except FlowError as err:
            return error_response(err.status, err.message)
        except _Answered as err:
            return err.response
        finally:
            if not handed_over:
                await self._close(held)

    async def _batch(
        self,
        path: str,
        body: dict[str, Any],
        prompts: list[Any],
        tenant: str,
        headers: dict[str, str],
    ) -> Response:
        """A batched completion request: each prompt through the flow on its own, the answers
        joined as vLLM joins them (``fanout.py``); the first failure is the batch's."""
        n = body["n"] if isinstance(body.get("n"), int) else 1
        subs = [dict(body, prompt=p) for p in prompts]
        answers = await asyncio.gather(
            *(self._one("completions", path, sub, tenant, headers) for sub in subs)
        )
        failed = next((a for a in answers if a.status_code != 200), None)
        if failed is not None or not body.get("stream"):
            for a in answers:
                if isinstance(a, Relay):
                    await a.discard()
            if failed is not None:
                return failed
            whole = join_whole([bytes(a.body) for a in answers], n)
            return Response(whole, 200, media_type="application/json")
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return Relay(
            joined([a for a in answers if isinstance(a, Relay)], StreamJoin(n, usage)), nothing
        )

    async def _place(self, held: Request, kind: str, body: dict[str, Any], tenant: str) -> None:
        stage = self.flow.stats.time_stage
        with stage("tokenize"):
            async with self._bounded(held, "the prompt's tokens (/tokenize on an instance)"):
                tokens = await self.tokens(kind, body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = limit if isinstance(limit, int) and limit > 0 else self.opts.default_max_tokens
        what = "its placement: the policy's queue, DE buffer slots and the storage read"
        with stage("place_and_read"):
            async with self._bounded(held, what):
                await held.place(tokens, max_tokens, tenant)

    async def _prefill(self, held: Request, body: dict[str, Any]) -> None:
        pbody = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
        pbody["max_tokens"] = 1
        pbody["kv_transfer_params"] = held.prefill_params()
        held.prefilling()
        with self.flow.stats.time_stage("prefill"):
            await self._post(held, held.placed.pe, "prefill", pbody)
        with self.flow.stats.time_stage("cnic_kv"):
            async with self._bounded(held, "the prefill's KV on its way to the decode node"):
                await asyncio.gather(held.hand_over(), held.persist_prompt())
        held.prefilled()

    async def _post(
        self, held: Request, engine: int, role: str, body: dict[str, Any]
    ) -> httpx.Response:
        """A whole answer of engine ``engine``'s instance, within the request's deadline; an
        error status is passed on to the client as the instance gave it."""
        node = self.flow.topology.node_of(engine)
        async with self._bounded(held, f"the {role} instance on node {node}"):
            try:
                r = await self.client.post(
                    self._url(engine, held.path), json=body, headers=held.headers
                )
            except httpx.HTTPError as err:
                raise FlowError(
                    503, f"{role} instance failed: {type(err).__name__}: {err}"
                ) from None
        if r.status_code != 200:
            raise _Answered(Response(r.content, r.status_code, media_type="application/json"))
        return r

    def _cached_tokens(self, held: Request) -> int:
        return held.hit_blocks * self.dep.block_tokens

    async def _whole(self, held: Request, dbody: dict[str, Any]) -> Response:
        with self.flow.stats.time_stage("decode"):
            r = await self._post(held, held.placed.de, "decode", dbody)
        held.decoding()
        held.close(Outcome.ANSWERED)
        content = with_cached_tokens(r.content, self._cached_tokens(held))
        return Response(content, 200, media_type="application/json")

    async def _stream(self, held: Request, dbody: dict[str, Any]) -> Response:
        """The decode's answer as SSE, once its first bytes came (then the decode has loaded
        its slots: ``flow.decoding``). The decode is asked for a usage on every event (the
        exact tokens generated: ``EventRelay``), which the relay takes out again where the
        client did not ask for it."""
        node = self.flow.topology.node_of(held.placed.de)
        asked = dbody.get("stream_options")
        asked = asked if isinstance(asked, dict) else {}
        dbody = dict(
            dbody, stream_options={**asked, "include_usage": True, "continuous_usage_stats": True}
        )
        req = self.client.build_request(
            "POST", self._url(held.placed.de, held.path), json=dbody, headers=held.headers
        )
        with self.flow.stats.time_stage("decode_first_byte"):
            async with self._bounded(held, f"the decode instance on node {node}"):
                try:
                    r = held.upstream = await self.client.send(req, stream=True)
                    if r.status_code != 200:
                        content = await r.aread()
                        raise _Answered(
                            Response(content, r.status_code, media_type="application/json")
                        )
                    chunks = r.aiter_raw()
                    first = await anext(chunks, b"")
                except httpx.HTTPError as err:
                    raise FlowError(
                        503, f"decode instance failed: {type(err).__name__}: {err}"
                    ) from None
        held.decoding()
        relay = EventRelay(
            self._cached_tokens(held),
            bool(asked.get("include_usage")),
            bool(asked.get("continuous_usage_stats")),
        )
        what = f"the decode instance on node {node}"

        async def events() -> AsyncIterator[bytes]:
            chunk: bytes | None = first
            while chunk is not None:
                out = relay.feed(chunk)
                held.generated(relay.take_tokens())  # the policy's tok_e
                if relay.done:  # the turn is counted finished before the client sees its end
                    held.close(Outcome.ANSWERED)
                if out:
                    yield out
                try:
                    async with self._bounded(held, what):
                        chunk = await anext(chunks, None)
                except FlowError as err:  # its deadline, or the decode went down: an error event
                    yield _sse_error(err.status, err.message)
                    return
                except httpx.HTTPError as err:  # the decode died mid-answer
                    yield _sse_error(503, f"decode instance failed: {type(err).__name__}")
                    return
            rest = relay.flush()
            held.close(Outcome.ANSWERED)
            if rest:
                yield rest

        return Relay(events(), lambda: self._close(held))

    # ------------------------------------------------------------ vLLM's other routes
    async def forward(
        self,
        method: str,
        path: str,
        content: bytes = b"",
        headers: Mapping[str, str] | None = None,
        stateful: bool = False,
    ) -> Response:
        """A route of vLLM's that the DualPath flow has no part in (``/tokenize``,
        ``/v1/models``, ``/v1/responses``, …), passed to an instance and its answer back as
        it is (a stream as it comes). Stateless routes go to the first instance that answers
        (prefill instances first); ``stateful`` ones (the Responses API keeps its responses
        in the instance) always to the first decode instance."""
        sent = {k: v for k, v in (headers or {}).items() if k.lower() in _FORWARDED_HEADERS}
        last: Exception | None = None
        for inst in self._forward_order(stateful):
            req = self.client.build_request(method, inst.url + path, content=content, headers=sent)
            try:
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as err:
                last = err
                continue
            kind = r.headers.get("content-type", "application/json")
            if kind.startswith("text/event-stream"):
                return Relay(r.aiter_raw(), r.aclose)
            try:
                body = await r.aread()
            except httpx.HTTPError as err:
                return error_response(503, f"vLLM instance {inst.url} failed: {err}")
            finally:
                await r.aclose()
            return Response(body, r.status_code, media_type=kind)
        return error_response(503, f"no vLLM instance answers {path}: {last}")

    def _forward_order(self, stateful: bool) -> list[Instance]:
        order = sorted(self.dep.instances, key=lambda i: (i.kind != "pe", i.node))
        if stateful:
            return [min((i for i in self.dep.instances if i.kind == "de"), key=lambda i: i.node)]
        return order

    async def close(self) -> None:
        await self.client.aclose()


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error", {})
        return str(err.get("message") if isinstance(err, dict) else err) or r.text
    except (ValueError, AttributeError):
        return r.text[:200]
