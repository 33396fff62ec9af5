"""What the HTTP front end needs from an inference backend (the seam to the runtime).

A backend takes a tokenised ``GenerateRequest`` and yields ``TokenEvent``s; closing the
iterator early (client gone, shutdown) must free the request. ``stats()`` feeds ``/metrics``.
``serve/runtime_backend.py`` implements it over the DualPath multi-process runtime, the one
engine (docs/serving.md); a test double or another engine can implement it too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from dualpath.frontend.tokenizer import TextTokenizer
from dualpath.tokens import TokenLogprob

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One completion: prompt token ids and sampling parameters (validated by the API)."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # special tokens left out of the text (vLLM's default)
    session_id: str | None = None  # keeps an agent's turns together for load counters
    tenant: str = ""  # salts the prefix hash chain: tenants never share cached KV
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k
    grammar: str = ""  # llguidance grammar the output must match ("" = free text)

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens is empty: a request needs at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is invalid: must be >= 1")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output since the last event. The first event carries the prompt accounting; the
    last one has ``finish_reason`` set ('stop' = EOS or stop string, 'length', 'abort')."""

    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked


@dataclass(slots=True)
class BackendStats:
    """A snapshot for ``/metrics``; counters are totals since start (monotonic)."""

    num_running: int = 0
    num_waiting: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preempted: int = 0  # requeues
    num_aborted: int = 0  # requests freed before finishing (client gone, shutdown)
    num_persist_failed: int = 0  # KV block writes dropped (e.g. full disk): not cached
    kv_bytes_by_path: dict[str, int] = field(default_factory=dict)  # by ``types.KVPath``
    utilisation: dict[str, float] = field(default_factory=dict)  # snic/cnic per node
    queue_lengths: dict[str, int] = field(default_factory=dict)  # read queues per node
    # per engine, under emulated GPU time: (passes or decode steps, those that overran it)
    gpu_passes: dict[str, tuple[int, int]] = field(default_factory=dict)


class BackendFailure(RuntimeError):
    """The backend cannot serve any more (its runtime died): requests get a 503."""


class Backend(Protocol):
    model_name: str
    tokenizer: TextTokenizer
    max_context_tokens: int
    vocab_size: int
    supports_grammar: bool  # grammar-constrained decoding (tool_choice, response_format)

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Abort what is still running and release every resource (threads, shared memory)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    def stats(self) -> BackendStats: ...

    def failure(self) -> str | None:
        """Why the backend cannot serve any more (``/health`` is then 503), or None."""
        ...

    def not_ready(self) -> str:
        """Why the backend cannot serve now though it has not failed (``/health`` is then
        503: it is recovering), or ""."""
        ...
