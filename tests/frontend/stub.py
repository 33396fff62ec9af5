"""Backend stubs for tests of the HTTP app alone: ``StubBackend`` (``/metrics``, ``/health``:
no request ever reaches ``generate``) and ``HangingBackend`` (every request hangs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class StubBackend:
    model_name = "stub"
    max_context_tokens = 1024
    vocab_size = 1024
    supports_grammar = False

    def __init__(
        self, num_running: int = 0, failure: str | None = None, not_ready: str = ""
    ) -> None:
        from dualpath.frontend.tokenizer import TinyTokenizer

        self.tokenizer = TinyTokenizer(self.vocab_size)
        self._num_running = num_running
        self._failure = failure
        self._not_ready = not_ready

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def generate(self, request: object) -> AsyncIterator[object]:
        raise AssertionError("the stub backend serves no request")

    def stats(self) -> object:
        from dualpath.frontend.backend import BackendStats

        return BackendStats(num_running=self._num_running)

    def failure(self) -> str | None:
        return self._failure

    def not_ready(self) -> str:
        return self._not_ready


class HangingBackend(StubBackend):
    """Every request streams ``num_tokens`` tokens, then never another (a stuck runtime);
    ``freed`` counts the requests whose generator was closed (the runtime's cancel)."""

    def __init__(self, num_tokens: int = 0) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.freed = 0

    async def generate(self, request: object) -> AsyncIterator[object]:  # type: ignore[override]
        from dualpath.frontend.backend import GenerateRequest, TokenEvent

        assert isinstance(request, GenerateRequest)
        try:
            for i in range(self.num_tokens):
                yield TokenEvent((7,), "x", len(request.prompt_tokens), 0, i + 1, None)
            await asyncio.Event().wait()  # never set
        finally:
            self.freed += 1
