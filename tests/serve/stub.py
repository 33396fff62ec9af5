"""A backend stub for tests of the HTTP app alone (``/metrics``, ``/health``): no request ever
reaches ``generate``."""

from __future__ import annotations

from collections.abc import AsyncIterator


class StubBackend:
    model_name = "stub"
    max_context_tokens = 1024
    vocab_size = 1024
    supports_grammar = False

    def __init__(self, num_running: int = 0, failure: str | None = None) -> None:
        from dualpath.serve.tokenizer import TinyTokenizer

        self.tokenizer = TinyTokenizer(self.vocab_size)
        self._num_running = num_running
        self._failure = failure

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def generate(self, request: object) -> AsyncIterator[object]:
        raise AssertionError("the stub backend serves no request")

    def stats(self) -> object:
        from dualpath.serve.backend import BackendStats

        return BackendStats(num_running=self._num_running)

    def failure(self) -> str | None:
        return self._failure
