"""What every generating route shares (``Service``): the caller's key, the body, the
``GenerateRequest``, the backend's token stream (timed, counted in the metrics however it
ends), and the server's API options. No routes here: ``frontend/api.py`` and
``frontend/responses.py`` define them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from dualpath.frontend.backend import Backend, BackendFailure, GenerateRequest, TokenEvent
from dualpath.frontend.body import BodyError, decode_object, read_limited
from dualpath.frontend.chat import ChatPlan
from dualpath.frontend.grammars import GrammarGate, GrammarLimits
from dualpath.frontend.metrics import ServeMetrics
from dualpath.frontend.schema import (
    MAX_SEED,
    ApiError,
    ChatRequest,
    Sampling,
    describe,
    unsupported_fields,
)
from dualpath.metrics import latency


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """``api_keys`` maps each accepted key to its tenant (empty: no key needed);
    ``metrics_open``: ``/metrics`` needs no key even when there are keys; ``tool_format``:
    how tool calls are written in the model's text (``tool_families.TOOL_PARSERS``);
    ``reasoning_parser``: how its ``<think>`` is split off (``reasoning.REASONING_PARSERS``);
    ``request_timeout_s``: every generation request ends this long after it arrived at the
    latest (queueing included), with a 504 or, in a stream, an error event."""

    api_keys: dict[str, str] = field(default_factory=dict)
    metrics_open: bool = False
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256
    max_stop_strings: int = 64
    tool_format: str = "hermes"
    reasoning_parser: str = ""  # a frontend/reasoning.py REASONING_PARSERS name ('' none)
    request_timeout_s: float = 300.0
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # frontend/grammars.py

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} is invalid: must be > 0")


class DeadlinePassed(Exception):
    """A request reached its ``request_timeout_s`` (its backend requests are cancelled)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request did not finish within request_timeout_s={timeout_s:g} s")


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


def tenant_of(api_keys: Mapping[str, str], request: Request) -> str:
    """The tenant of ``request``'s ``Authorization: Bearer KEY`` ('' when ``api_keys``, key →
    tenant, is empty); ``ApiError`` 401 for a missing or unknown key. Every server of
    ``dualpath serve`` checks keys here (the runtime's API, the vLLM router)."""
    if not api_keys:
        return ""
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if key not in api_keys:
        raise ApiError(401, "invalid or missing API key")
    return api_keys[key]


class Service:
    """What every generating route shares: the caller's key, the body, the
    ``GenerateRequest``, and the backend's token stream (timed, and counted in the metrics
    when it ends, however it ends)."""

    def __init__(self, backend: Backend, opts: ApiOptions, metrics: ServeMetrics) -> None:
        self.backend, self.opts, self.metrics = backend, opts, metrics
        # grammars compile for the engines' vocabulary where the backend can build it
        self.grammars = GrammarGate(opts.grammar, getattr(backend, "grammar_tokenizer", None))

    async def check_grammar(self, plan: ChatPlan) -> None:
        """A 400 naming the field when the plan's grammar is over a limit or invalid."""
        if plan.grammar:
            await self.grammars.check(plan.grammar, plan.grammar_param)

    def authorise(self, request: Request) -> str:
        """The caller's tenant ('' without API keys); 401 for a missing or unknown key."""
        return tenant_of(self.opts.api_keys, request)

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

    def to_request(
        self,
        body: Sampling,
        prompt: list[int],
        request: Request,
        grammar: str = "",
        logprobs: int | None = None,
        prompt_param: str = "",
    ) -> GenerateRequest:
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
                raise ApiError(
                    400, f"logit_bias: {key!r} is not a token id of this model", "logit_bias"
                )
            if not -100 <= value <= 100:
                raise ApiError(
                    400, f"logit_bias: {value} for {key} is outside [-100, 100]", "logit_bias"
                )
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
            skip_special_tokens=body.skip_special_tokens,
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

    async def tokens(
        self, gens: list[GenerateRequest], arrived: float
    ) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """``(choice, event)`` of every ``gens[choice]`` as they come, until all have ended;
        raises the backend's failure, or ``DeadlinePassed`` at ``request_timeout_s`` after
        ``arrived``. Closing it early (use ``contextlib.aclosing``) frees
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
        deadline = arrived + self.opts.request_timeout_s
        try:
            running = len(gens)
            while running:
                # not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that
                # meets a ready item (a client gone mid-stream would then run to the end)
                getter = asyncio.ensure_future(out.get())
                try:
                    left = max(0.0, deadline - time.monotonic())
                    done, _ = await asyncio.wait({getter}, timeout=left)
                except BaseException:
                    getter.cancel()
                    raise
                if not done:
                    getter.cancel()
                    self.metrics.request_timeouts.inc()
                    raise DeadlinePassed(self.opts.request_timeout_s)
                i, item = getter.result()
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

    async def whole(
        self,
        request: Request,
        gens: list[GenerateRequest],
        arrived: float,
        on_event: Callable[[int, TokenEvent], None],
    ) -> list[TokenEvent] | None:
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
                except DeadlinePassed as exc:
                    raise ApiError(504, str(exc)) from None

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
            m.ttft.observe(latency.ttft_s(t.arrived, t.first))
            itl = latency.itl_s(t.first, t.last or t.first, last.num_generated_tokens)
            if itl is not None:  # (events may carry several tokens: no second-token time)
                m.itl.observe(itl)
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.generation_tokens.inc(last.num_generated_tokens)
        m.request_success.labels(finished_reason=last.finish_reason or "abort").inc()
