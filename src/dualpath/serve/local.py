"""In-process backend: one engine thread runs continuous batching over the HF or tiny model,
with prefix KV reuse from ``PrefixCache``. The asyncio side only queues requests and relays
``TokenEvent``s; the engine thread owns the model, the cache and every running sequence.

Each step: every running sequence decodes one token, and admitted requests prefill their
uncached suffix in chunks (chunked prefill) in the same forward while the step's token
budget lasts, so a long prompt never stalls the decodes for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from dualpath.runtime.hf_model import SequenceKV
from dualpath.runtime.model import TinyTransformer
from dualpath.serve.backend import BackendStats, GenerateRequest, TokenEvent
from dualpath.serve.generation import TextStream, sample
from dualpath.serve.prefix_cache import PrefixCache
from dualpath.serve.tokenizer import TextTokenizer

log = logging.getLogger("dualpath.serve")


class BatchModel(Protocol):
    num_layers: int
    max_context_tokens: int
    vocab_size: int

    @property
    def kv_row_bytes(self) -> int: ...

    def new_sequence(self, capacity_tokens: int) -> SequenceKV: ...

    def forward_batch(self, items: Sequence[tuple[Sequence[int], SequenceKV]]) -> Tensor: ...


class TinyBatchModel:
    """The built-in tiny model behind the batched interface (one prefill call per sequence)."""

    def __init__(self, model: TinyTransformer) -> None:
        self.model = model
        self.num_layers = model.num_layers
        self.max_context_tokens = model.config.max_context_tokens
        self.vocab_size = model.config.vocab_size

    @property
    def kv_row_bytes(self) -> int:
        return self.model.kv_row_bytes

    def new_sequence(self, capacity_tokens: int) -> SequenceKV:
        return SequenceKV([self.model.empty_kv(capacity_tokens) for _ in range(self.num_layers)])

    def forward_batch(self, items: Sequence[tuple[Sequence[int], SequenceKV]]) -> Tensor:
        out = []
        for tokens, seq in items:
            start = seq.length
            out.append(
                self.model.prefill(tokens, seq.past, lambda i, kv: seq.put(i, start, kv))  # noqa: B023
            )
            seq.length = start + len(tokens)
        return torch.stack(out)


@dataclass(eq=False, slots=True)
class _Running:
    req: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent]
    stream: TextStream
    generator: torch.Generator
    namespace: str
    seq: SequenceKV | None = None
    cached: int = 0
    prefilled: int = 0  # prompt tokens whose KV is in seq (cached + computed so far)
    generated: list[int] = field(default_factory=list)
    aborted: bool = False  # set by the event loop when the client goes away


@dataclass(frozen=True, slots=True)
class LocalOptions:
    max_batch_seqs: int = 32
    max_batch_tokens: int = 512  # new tokens per forward: long prompts prefill in chunks
    block_tokens: int = 16  # prefix-cache block (vLLM's default block size)
    cache_blocks: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch_seqs", "max_batch_tokens", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")


class LocalBackend:
    """``Backend`` over an in-process model (see the module docstring)."""

    def __init__(
        self,
        model: BatchModel,
        tokenizer: TextTokenizer,
        model_name: str,
        options: LocalOptions | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.options = options or LocalOptions()
        self.max_context_tokens = model.max_context_tokens
        self.vocab_size = model.vocab_size
        self.cache = PrefixCache(self.options.block_tokens, self.options.cache_blocks)
        self._cond = threading.Condition()
        self._waiting: deque[_Running] = deque()
        self._running: list[_Running] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._seed_rng = torch.Generator().manual_seed(self.options.seed)
        self._stats = BackendStats(kv_bytes_by_path={"local_hit": 0, "persist": 0})

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._engine_loop, name="dualpath-engine")
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def stats(self) -> BackendStats:
        s = self._stats
        return BackendStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preempted=0,
            num_aborted=s.num_aborted,
            kv_bytes_by_path=dict(s.kv_bytes_by_path),
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        total = len(request.prompt_tokens) + request.max_tokens
        if total > self.max_context_tokens:
            raise ValueError(
                f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds the model's context of "
                f"{self.max_context_tokens} tokens"
            )
        seed = request.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        r = _Running(
            req=request,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            stream=TextStream(self.tokenizer, request.stop),
            generator=torch.Generator().manual_seed(seed),
            namespace=f"{self.model_name}/{request.tenant}",
        )
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._waiting.append(r)
            self._cond.notify_all()
        try:
            while True:
                event = await r.queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            r.aborted = True  # frees the sequence at the engine's next step
            with self._cond:
                self._cond.notify_all()

    # -- engine thread ---------------------------------------------------------------------

    def _engine_loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = self._admit()
            still = [r for r in self._running if not r.aborted]
            self._stats.num_aborted += len(self._running) - len(still)
            self._running = still
            self._running.extend(admitted)
            if self._running:
                self._step()
        for r in [*self._running, *self._waiting]:
            self._emit(r, "", (), "abort")
        self._running, self._waiting = [], deque()

    def _admit(self) -> list[_Running]:
        slots = self.options.max_batch_seqs - len(self._running)
        out: list[_Running] = []
        while self._waiting and slots > 0:
            r = self._waiting.popleft()
            if not r.aborted:
                out.append(r)
                slots -= 1
        return out

    def _start(self, r: _Running) -> SequenceKV:
        """Allocate the sequence's KV and load its cached prefix."""
        prompt = r.req.prompt_tokens
        r.seq = seq = self.model.new_sequence(len(prompt) + r.req.max_tokens)
        r.cached = r.prefilled = self.cache.load(prompt, r.namespace, seq)
        self._stats.prefix_query_tokens += len(prompt)
        self._stats.prefix_hit_tokens += r.cached
        self._stats.kv_bytes_by_path["local_hit"] += (
            r.cached * self.model.kv_row_bytes * self.model.num_layers
        )
        return seq

    def _plan(self) -> list[tuple[_Running, SequenceKV, Sequence[int], bool]]:
        """This step's work: every decode (one token each), then prefill chunks of the
        remaining token budget in admission order. (request, new tokens, samples?)."""
        work: list[tuple[_Running, SequenceKV, Sequence[int], bool]] = []
        budget = self.options.max_batch_tokens
        for r in self._running:
            if r.seq is not None and r.prefilled == len(r.req.prompt_tokens):
                work.append((r, r.seq, r.generated[-1:], True))
                budget -= 1
        for r in self._running:
            seq = r.seq if r.seq is not None else self._start(r)
            prompt = r.req.prompt_tokens
            if r.prefilled == len(prompt) or (budget <= 0 and work):
                continue
            n = min(len(prompt) - r.prefilled, max(budget, 1))
            last = r.prefilled + n == len(prompt)
            work.append((r, seq, prompt[r.prefilled : r.prefilled + n], last))
            r.prefilled += n
            budget -= n
        return work

    def _step(self) -> None:
        work = self._plan()
        try:
            logits = self.model.forward_batch([(toks, seq) for _, seq, toks, _ in work])
        except Exception:  # a failed step aborts its requests, the server keeps serving
            log.exception("engine step failed; aborting %d requests", len(self._running))
            for r in self._running:
                self._emit(r, "", (), "abort")
            self._running = []
            return
        done: set[int] = set()
        for (r, _, _, samples), row in zip(work, logits, strict=True):
            if samples and not self._on_token(r, row):
                done.add(id(r))
        self._running = [r for r in self._running if id(r) not in done]

    def _on_token(self, r: _Running, logits: Tensor) -> bool:
        """Sample, detokenise, check stops; returns True while the request keeps running."""
        req = r.req
        token = sample(logits, req.temperature, req.top_p, r.generator)
        r.generated.append(token)
        is_eos = token in self.tokenizer.eos_token_ids and not req.ignore_eos
        text = "" if is_eos else r.stream.push(token)
        finish: str | None = None
        if r.stream.stopped or is_eos:
            finish = "stop"
        elif len(r.generated) >= req.max_tokens:
            finish = "length"
        if finish is not None and not r.stream.stopped:
            text += r.stream.finish()
        self._emit(r, text, (token,), finish)
        if finish is not None:
            self._finish(r)
            return False
        if r.aborted:
            self._stats.num_aborted += 1
            return False
        return True

    def _finish(self, r: _Running) -> None:
        if r.seq is None:
            return
        tokens = (*r.req.prompt_tokens, *r.generated)
        added = self.cache.store(tokens, r.namespace, r.seq)
        self._stats.kv_bytes_by_path["persist"] += (
            added * self.cache.block_tokens * self.model.kv_row_bytes * self.model.num_layers
        )
        r.seq = None

    def _emit(self, r: _Running, text: str, ids: tuple[int, ...], finish: str | None) -> None:
        event = TokenEvent(
            token_ids=ids,
            text=text,
            num_prompt_tokens=len(r.req.prompt_tokens),
            num_cached_tokens=r.cached,
            num_generated_tokens=len(r.generated),
            finish_reason=finish,
        )
        with contextlib.suppress(RuntimeError):  # the event loop is closed (shutdown)
            r.loop.call_soon_threadsafe(r.queue.put_nowait, event)
