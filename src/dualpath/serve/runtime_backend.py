"""``Backend`` over the DualPath multi-process runtime: what ``dualpath serve`` runs.

The scheduler runs in its own process (``serve/runtime_host.py``) with the storage workers
and engines as its children: every request goes through the policy core, the storage read
(PE or DE side), layerwise prefill on a PE and batched decode on a DE, which streams each
step's tokens back (a ``TokensMsg`` per step). Sampling (temperature, top-p, seed,
EOS) happens on the engines; stop strings here, which then cancel the request in the runtime.
KV reuse is the persistent store's content hash chain: a resent conversation gets its
durable Full Blocks as hits, salted per tenant. The model is the preset's built-in tiny model or
a Hugging Face checkpoint (``RuntimeOptions.model_dir``), built in every engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import queue
import shutil
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from dualpath.config import Config
from dualpath.frontend.backend import BackendFailure, BackendStats, GenerateRequest, TokenEvent
from dualpath.frontend.generation import TextStream
from dualpath.frontend.tokenizer import TextTokenizer
from dualpath.metrics.hops import hop
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.sampling import SamplingParams
from dualpath.serve.runtime_host import (
    CancelCmd,
    ClosedEvt,
    FailedEvt,
    HealthEvt,
    ReadyEvt,
    RejectedEvt,
    StatsEvt,
    StopCmd,
    SubmitCmd,
    TokensEvt,
    host_main,
)
from dualpath.tokens import TokenLogprob

UTIL_WINDOW_S = 5.0  # NIC utilisation: busy time over the last few stats snapshots
STOP_TIMEOUT_S = 30.0


@dataclass(eq=False, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokensEvt | RejectedEvt | ClosedEvt]


class RuntimeBackend:
    """``Backend`` over ``Runtime`` (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        options: RuntimeOptions,
        tokenizer: TextTokenizer,
        model_name: str,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.options = options
        self.tokenizer = tokenizer
        self.model_name = model_name
        # a request's whole KV (prompt + output) must fit one engine's HBM pool
        block = config.scheduler.block_tokens
        pool_tokens = max(1, options.hbm_tokens // block) * block
        self.max_context_tokens = min(config.model.max_context_tokens, pool_tokens)
        self.vocab_size = config.model.vocab_size
        self.supports_grammar = options.vocab is not None
        self._seeds = itertools.count(seed * 1_000_003 + 1)
        self._keys = itertools.count()
        self._streams: dict[int, _Stream] = {}
        self._ctx = mp.get_context("spawn")
        self._inbox: Any = None
        self._outbox: Any = None
        self._proc: Any = None
        self._reader: threading.Thread | None = None
        self._closed: ClosedEvt | None = None
        self._stopping = False
        self._stats = StatsEvt(0, 0, 0, 0)
        self._history: deque[StatsEvt] = deque()
        self._num_aborted = 0
        self._prompt_tokens = 0  # counted here, so /metrics agrees with the responses at once
        self._cached_tokens = 0
        self.pids: tuple[int, ...] = ()
        self._ready: ReadyEvt | None = None
        self._failure: str | None = None  # why the runtime died under us (None: healthy)
        self._not_ready = ""  # why the runtime cannot serve now ("" : it can), ``HealthEvt``
        # called once, from the reader thread, when the runtime dies (the server exits)
        self.on_failure: Callable[[str], None] | None = None

    def grammar_tokenizer(self) -> Any:
        """The llguidance tokenizer the engines compile grammars with (``frontend/grammars.py``
        compiles each new grammar with it first, to check it and bound its cost)."""
        from dualpath.runtime.token_choice import build_tokenizer

        if self.options.vocab is None:
            raise ValueError("this backend has no vocabulary for grammars")
        return build_tokenizer(self.options.vocab, self.vocab_size)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._start_blocking)

    def _start_blocking(self) -> None:
        self._inbox, self._outbox = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(
            target=host_main,
            args=(self.config, self.options, self._inbox, self._outbox, os.getpid()),
            name="dualpath-scheduler",
        )
        self._proc.start()
        timeout_s = self.options.ready_timeout_s + 10.0
        try:
            first = self._outbox.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise RuntimeError(f"the runtime did not start within {timeout_s:g} s") from None
        if isinstance(first, ClosedEvt):
            self._proc.join(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(f"the runtime failed to start: {first.error}")
        assert isinstance(first, ReadyEvt)
        self._ready = first
        self.pids = first.pids
        self._reader = threading.Thread(target=self._read_loop, name="runtime-events")
        self._reader.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        if self._proc is None:
            return
        self._stopping = True
        if self._proc.is_alive():
            self._inbox.put(StopCmd())
        self._proc.join(timeout=STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout=5.0)
        self._closed = self._closed or ClosedEvt()  # a clean stop: in-flight streams abort
        for key in list(self._streams):
            self._deliver(key, self._closed)
        self._proc = None

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(timeout=5.0)

    def _read_loop(self) -> None:
        """Relay the scheduler process's events to the waiting requests' event loops."""
        while True:
            try:
                evt = self._outbox.get(timeout=0.5)
            except queue.Empty:
                proc = self._proc
                if proc is None or not proc.is_alive():
                    code = proc.exitcode if proc is not None else None
                    evt = ClosedEvt(f"the scheduler process exited (code {code})")
                else:
                    continue
            if isinstance(evt, StatsEvt):
                self._stats = evt
                self._history.append(evt)
                while self._history and evt.now_s - self._history[0].now_s > UTIL_WINDOW_S:
                    self._history.popleft()
            elif isinstance(evt, (TokensEvt, RejectedEvt)):
                hop("backend.relay", evt.key)
                self._deliver(evt.key, evt)
            elif isinstance(evt, HealthEvt):
                self._not_ready = evt.not_ready
            elif isinstance(evt, FailedEvt) and not self._stopping:
                self._failing(evt.error)  # /health 503 and clean errors now, not in seconds
            elif isinstance(evt, ClosedEvt):
                if self._stopping:  # we asked it to stop: whatever it says, a clean stop
                    evt = ClosedEvt()
                elif not evt.error:
                    evt = ClosedEvt("the runtime stopped by itself")
                if evt.error:
                    self._failing(evt.error)
                    self._clean_up()
                self._closed = self._closed or evt
                for key in list(self._streams):
                    self._deliver(key, self._closed)
                return

    def _failing(self, error: str) -> None:
        """The runtime failed (its run raised, or its scheduler process was killed): say so
        once, mark the backend failed (``/health`` 503, requests 503), end every stream with a
        clean error, and tell the server (fail-fast: it exits non-zero)."""
        if self._failure is not None:
            return
        self._failure = error
        print(f"dualpath serve: runtime stopped: {error}", file=sys.stderr, flush=True)
        self._closed = ClosedEvt(error)
        for key in list(self._streams):
            self._deliver(key, self._closed)
        if self.on_failure is not None:
            self.on_failure(error)

    def _clean_up(self) -> None:
        """Remove what a dead scheduler process cannot (its shared memory, the links
        directory; the children exit by themselves when their parent is gone)."""
        if self._ready is not None:
            from multiprocessing.shared_memory import SharedMemory

            for name in self._ready.shm_names:
                with contextlib.suppress(OSError):
                    seg = SharedMemory(name=name)
                    seg.close()
                    seg.unlink()
            if self._ready.link_dir:
                shutil.rmtree(self._ready.link_dir, ignore_errors=True)

    def failure(self) -> str | None:
        return self._failure

    def not_ready(self) -> str:
        """Why the runtime cannot serve now, though it has not failed ("" : it can): a
        process of it is being restarted."""
        return self._not_ready

    def _deliver(self, key: int, evt: TokensEvt | RejectedEvt | ClosedEvt) -> None:
        s = self._streams.get(key)
        if s is None:
            return
        with contextlib.suppress(RuntimeError):  # its event loop is closed (shutdown)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, evt)

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        if self._closed is not None or self._proc is None:
            raise BackendFailure(self._failure or "the runtime is not running")
        seed = request.seed if request.seed is not None else next(self._seeds)
        eos = () if request.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        sampling = SamplingParams(
            request.temperature,
            request.top_p,
            seed,
            eos,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias,
            logprobs=request.logprobs,
            grammar=request.grammar,
        )
        key = next(self._keys)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[key] = stream
        hop("backend.submit", key)
        self._inbox.put(
            SubmitCmd(key, request.prompt_tokens, request.max_tokens, sampling, request.tenant)
        )
        text = TextStream(self.tokenizer, request.stop, request.skip_special_tokens)
        generated = 0
        cached = 0
        finished = False
        held: TokenEvent | None = None  # the final event, until the runtime reports done

        lps: list[TokenLogprob] = []  # received, not yet handed out (one per token)

        def event(ids: tuple[int, ...], delta: str, finish: str | None) -> TokenEvent:
            mine = tuple(lps[: len(ids)]) if request.logprobs is not None else ()
            del lps[: len(mine)]
            return TokenEvent(
                ids, delta, len(request.prompt_tokens), cached, generated, finish, mine
            )

        try:
            while True:
                evt = await stream.queue.get()
                hop("backend.event", key)
                if isinstance(evt, RejectedEvt):
                    finished = True
                    raise ValueError(evt.text)
                if isinstance(evt, ClosedEvt):
                    finished = True
                    if evt.error:  # died mid-request: a clean error, not a cut answer
                        raise BackendFailure(evt.error)
                    yield event((), "", "abort")
                    return
                if not generated and held is None:  # the first event: prompt accounting
                    self._prompt_tokens += len(request.prompt_tokens)
                    self._cached_tokens += evt.cached_tokens
                cached = evt.cached_tokens
                lps.extend(evt.logprobs)
                if held is not None:
                    if evt.done:  # the turn's blocks are durable: a resend will hit them
                        finished = True
                        yield held
                        return
                    continue
                for token in evt.tokens:
                    generated += 1
                    is_eos = token in eos
                    delta = "" if is_eos else text.push(token)
                    finish = None
                    if text.stopped or is_eos:
                        finish = "stop"
                    elif generated >= request.max_tokens:
                        finish = "length"
                    if finish is not None and not text.stopped:
                        delta += text.finish()
                    if finish is None:
                        yield event((token,), delta, None)
                    elif text.stopped:  # the runtime would go on: cancelled below
                        yield event((token,), delta, finish)
                        return
                    else:  # EOS or max_tokens end it in the runtime too
                        held = event((token,), delta, finish)
                        break
                if held is not None and evt.done:
                    finished = True
                    yield held
                    return
                if held is None and evt.done:  # ended without a reason here (not normally)
                    finished = True
                    yield event((), text.finish(), "length")
                    return
        finally:
            self._streams.pop(key, None)
            if not finished and self._closed is None and self._inbox is not None:
                self._inbox.put(CancelCmd(key))  # client gone or stop string: free it
                if not text.stopped:
                    self._num_aborted += 1

    # -- metrics ----------------------------------------------------------------------------

    def stats(self) -> BackendStats:
        s = self._stats
        return BackendStats(
            num_running=max(0, s.num_live - s.num_waiting),
            num_waiting=s.num_waiting,
            prefix_query_tokens=self._prompt_tokens,
            prefix_hit_tokens=self._cached_tokens,
            num_preempted=s.requeued,
            num_aborted=self._num_aborted,
            num_persist_failed=s.persist_failed,
            kv_bytes_by_path=dict(s.kv_bytes_by_path),
            utilisation=self._utilisation(),
            queue_lengths=dict(s.queue_lengths),
            gpu_passes=dict(s.gpu_passes),
        )

    def _utilisation(self) -> dict[str, float]:
        """Busy fraction of each emulated NIC over the last ``UTIL_WINDOW_S`` (pacer time)."""
        if len(self._history) < 2:
            return {}
        a, b = self._history[0], self._history[-1]
        span = b.now_s - a.now_s
        if span <= 0:
            return {}
        return {
            nic: min(1.0, max(0.0, (busy - a.nic_busy_s.get(nic, 0.0)) / span))
            for nic, busy in sorted(b.nic_busy_s.items())
        }
