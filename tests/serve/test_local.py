"""The local backend: concurrent requests batched together give each one the tokens it gets
alone (greedy), also with chunked prefill; a resent prompt hits the prefix cache, closing a stream frees it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dualpath.runtime.hf_model import HFTransformer  # noqa: E402
from dualpath.serve.backend import GenerateRequest, TokenEvent  # noqa: E402
from dualpath.serve.local import LocalBackend, LocalOptions  # noqa: E402
from dualpath.serve.tokenizer import HFTokenizer  # noqa: E402


def _greedy(model: HFTransformer, prompt: list[int], n: int) -> list[int]:
    seq = model.new_sequence(len(prompt) + n)
    out = [int(model.forward_batch([(prompt, seq)])[0].argmax())]
    while len(out) < n:
        out.append(int(model.forward_batch([(out[-1:], seq)])[0].argmax()))
    return out


async def _collect(backend: LocalBackend, req: GenerateRequest) -> list[TokenEvent]:
    return [ev async for ev in backend.generate(req)]


@pytest.mark.parametrize("max_batch_tokens", [512, 5])  # 5: prompts prefill in chunks
def test_concurrent_requests_match_sequential_greedy(
    hf_checkpoint: Path, max_batch_tokens: int
) -> None:
    model = HFTransformer.from_dir(hf_checkpoint)
    options = LocalOptions(block_tokens=4, max_batch_tokens=max_batch_tokens)
    backend = LocalBackend(model, HFTokenizer.from_dir(hf_checkpoint), "m", options)
    prompts = [[(7 * i + j) % model.vocab_size for j in range(5 + 3 * i)] for i in range(6)]
    reqs = [
        GenerateRequest(str(i), tuple(p), max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]

    async def main() -> list[list[TokenEvent]]:
        await backend.start()
        try:
            first = await asyncio.gather(*(_collect(backend, r) for r in reqs))
            again = await _collect(backend, reqs[5])  # same prompt: served from the cache
            return [*first, again]
        finally:
            await backend.stop()

    results = asyncio.run(main())
    for events, prompt in zip(results[:6], prompts, strict=True):
        tokens = [t for ev in events for t in ev.token_ids]
        assert tokens == _greedy(model, prompt, 12)
        assert events[-1].finish_reason == "length"
        assert events[-1].num_generated_tokens == 12
    last = results[6]
    assert last[-1].num_cached_tokens == (len(prompts[5]) - 1) // 4 * 4 > 0
    assert [t for ev in last for t in ev.token_ids] == _greedy(model, prompts[5], 12)


def test_closing_the_stream_aborts_the_request(hf_checkpoint: Path) -> None:
    model = HFTransformer.from_dir(hf_checkpoint)
    backend = LocalBackend(model, HFTokenizer.from_dir(hf_checkpoint), "m")
    req = GenerateRequest("x", (1, 2, 3), max_tokens=3000, ignore_eos=True)

    async def main() -> int:
        await backend.start()
        try:
            events = backend.generate(req)
            await anext(events)
            await events.aclose()  # type: ignore[attr-defined]
            for _ in range(200):
                if backend.stats().num_aborted:
                    break
                await asyncio.sleep(0.01)
            return backend.stats().num_running
        finally:
            await backend.stop()

    assert asyncio.run(main()) == 0
    assert backend.stats().num_aborted == 1
