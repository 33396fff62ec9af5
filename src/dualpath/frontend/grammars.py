"""Grammar admission off the event loop: a constrained request's grammar (a forced tool call,
a JSON schema) is checked against a size limit at once, then compiled — as an engine will
compile it, with the engines' vocabulary — on one worker thread within a time budget (the
grammar library releases the GIL, so the event loop and the engines keep running). Verdicts
are cached by the grammar's hash: a schema compiles once however many requests carry it,
and one over the budget is refused at once the next time. Over either limit is a 400 naming
the field the grammar came from.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dualpath.frontend.schema import ApiError
from dualpath.frontend.tools import grammar_error
from dualpath.tokens import grammar_key

MAX_VERDICTS = 512  # grammars whose verdict is remembered (LRU)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """``max_bytes`` of grammar text; ``budget_s`` to compile it (the worker's own time, not
    its queue's)."""

    max_bytes: int = 128 << 10
    budget_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"--max-grammar-bytes {self.max_bytes} is invalid: must be >= 1")
        if not self.budget_s > 0:
            raise ValueError(f"--grammar-budget-s {self.budget_s} is invalid: must be > 0")


class GrammarGate:
    """``check`` each constrained request's grammar (see the module docstring).
    ``tokenizer``: builds the engines' llguidance tokenizer (None: validate the grammar
    without compiling it for a vocabulary)."""

    def __init__(self, limits: GrammarLimits, tokenizer: Callable[[], Any] | None) -> None:
        self.limits = limits
        self._make_tokenizer = tokenizer
        self._tokenizer: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._verdicts: OrderedDict[str, str] = OrderedDict()  # key → "" (ok) or the refusal
        self._pending: dict[str, asyncio.Task[str]] = {}
        self.num_compiled = 0
        self.num_cached = 0
        self.num_refused = 0
        self.compile_s = 0.0  # the worker's time, in all

    async def check(self, grammar: str, param: str) -> None:
        """Return if ``grammar`` may be served; ApiError (400, naming ``param``) if not."""
        size = len(grammar.encode())
        if size > self.limits.max_bytes:
            self.num_refused += 1
            raise ApiError(
                400,
                f"{param}: its grammar is {size} bytes, over the server's "
                f"limit of {self.limits.max_bytes} (--max-grammar-bytes)",
                param,
            )
        key = grammar_key(grammar)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = await self._compiled(key, grammar)
        else:
            self.num_cached += 1
            self._verdicts.move_to_end(key)
        if verdict:
            self.num_refused += 1
            raise ApiError(400, f"{param}: {verdict}", param)

    async def _compiled(self, key: str, grammar: str) -> str:
        task = self._pending.get(key)
        if task is None:  # the first request with this grammar compiles it; the rest wait
            task = self._pending[key] = asyncio.ensure_future(self._run(key, grammar))
        return await asyncio.shield(task)

    async def _run(self, key: str, grammar: str) -> str:
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        work = loop.run_in_executor(self._pool, self._compile, grammar, loop, started)
        await started  # the budget counts from when the worker takes it up
        try:
            verdict = await asyncio.wait_for(asyncio.shield(work), self.limits.budget_s)
        except TimeoutError:
            verdict = (
                f"its grammar takes over {self.limits.budget_s:g} s to compile "
                "(--grammar-budget-s); simplify the schema"
            )
        except Exception as exc:  # the library refused it by raising
            verdict = str(exc).split("\n")[0] or type(exc).__name__
        self._verdicts[key] = verdict
        while len(self._verdicts) > MAX_VERDICTS:
            self._verdicts.popitem(last=False)
        del self._pending[key]
        return verdict

    def _compile(
        self, grammar: str, loop: asyncio.AbstractEventLoop, started: asyncio.Future[None]
    ) -> str:
        """On the worker: '' when ``grammar`` compiles, else why not."""
        import llguidance

        try:
            if self._tokenizer is None and self._make_tokenizer is not None:
                self._tokenizer = self._make_tokenizer()  # once; before the budget starts
        finally:
            loop.call_soon_threadsafe(started.set_result, None)
        t0 = time.perf_counter()
        self.num_compiled += 1  # counted when it starts (a compile over budget goes on)
        try:
            if self._tokenizer is None:
                return grammar_error(grammar).split("\n")[0]
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            return str(matcher.get_error()).split("\n")[0] if matcher.is_error() else ""
        finally:
            self.compile_s += time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarCollector:
    """``/metrics``: grammars compiled, served from the cache, refused; compile seconds."""

    def __init__(self, gate: GrammarGate) -> None:
        self.gate = gate

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        g = self.gate
        for name, doc, value in (
            ("grammar_compiles", "Grammars compiled to check them", g.num_compiled),
            ("grammar_cache_hits", "Grammar checks served from the cache", g.num_cached),
            ("grammar_refusals", "Grammars refused (size, budget, invalid)", g.num_refused),
            ("grammar_compile_seconds", "Time spent compiling grammars", g.compile_s),
        ):
            yield CounterMetricFamily(f"dualpath:{name}", doc, value=value)
