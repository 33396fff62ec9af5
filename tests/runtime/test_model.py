"""The runtime model: batched layerwise forward over a cached prefix equals full recompute."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dualpath.config import MODEL_PRESETS  # noqa: E402
from dualpath.runtime.hbm import HbmPool, PagedKV  # noqa: E402
from dualpath.runtime.model import (  # noqa: E402
    CacheBatch,
    KVCache,
    TinyTransformer,
    greedy_generate,
)

TINY = MODEL_PRESETS["tiny"]
ATOL = 1e-4  # float32, different matmul shapes: layerwise vs full recompute


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    torch.set_num_threads(1)
    return TinyTransformer(TINY, seed=7)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY.vocab_size) for _ in range(n)]


def test_kv_row_matches_model_config(model: TinyTransformer) -> None:
    assert model.kv_row_bytes == TINY.kv_bytes_per_token_per_layer
    layer = KVCache(model, 3).layers[0]
    assert layer.numel() * layer.element_size() == 3 * TINY.kv_bytes_per_token_per_layer


def test_weights_are_deterministic_from_seed() -> None:
    a, b = TinyTransformer(TINY, seed=3), TinyTransformer(TINY, seed=3)
    c = TinyTransformer(TINY, seed=4)
    assert torch.equal(a.layers[0].wq, b.layers[0].wq)
    assert not torch.equal(a.layers[0].wq, c.layers[0].wq)


@pytest.mark.parametrize("cached", [0, 64, 130])
def test_layerwise_prefill_with_cached_prefix_equals_recompute(
    model: TinyTransformer, cached: int
) -> None:
    prompt = _tokens(200, seed=cached)
    full = KVCache(model, 200)
    ref_logits = full.extend(model, prompt)
    # cache the prefix, then prefill only the rest layer by layer
    part = KVCache(model, 200)
    if cached:
        part.extend(model, prompt[:cached])
    seen: list[int] = []
    logits = model.forward_batch(
        [prompt[cached:]], CacheBatch([part]), lambda layer, h: seen.append(h.shape[0]) or None
    )[0]
    assert seen == [200 - cached] * TINY.num_layers
    assert part.length == 200
    assert torch.allclose(logits, ref_logits, atol=ATOL)
    assert int(logits.argmax()) == int(ref_logits.argmax())
    if cached:
        for layer in range(TINY.num_layers):
            assert torch.allclose(part.past(layer), full.past(layer), atol=ATOL)


def test_greedy_continuation_from_cached_kv_matches_generate(model: TinyTransformer) -> None:
    prompt = _tokens(150, seed=1)
    ref, ref_cache = greedy_generate(model, prompt, 12)
    assert ref_cache.length == 150 + 11
    cache = KVCache(model, 200)
    for layer in range(TINY.num_layers):  # KV as if loaded from storage for the first 128
        cache.layers[layer][:128] = ref_cache.past(layer)[:128]
    cache.length = 128
    out = [int(cache.extend(model, prompt[128:]).argmax())]
    while len(out) < 12:
        out.append(int(cache.extend(model, out[-1:]).argmax()))
    assert out == ref
    assert len(set(ref)) > 1  # the weights do not collapse to one token


def test_prefill_rejects_empty_and_non_gqa() -> None:
    m = TinyTransformer(TINY, seed=0)
    with pytest.raises(ValueError, match="needs >= 1 new token"):
        m.forward_batch([[]], CacheBatch([KVCache(m, 4)]))
    with pytest.raises(ValueError, match=r"model\.attention"):
        TinyTransformer(MODEL_PRESETS["ds27b"])


def test_batch_of_prefills_and_decodes_equals_each_alone(model: TinyTransformer) -> None:
    """One padded forward over sequences of different cached and new lengths."""
    a, b, c = _tokens(70, 11), _tokens(33, 12), _tokens(5, 13)
    ca, cb, cc = KVCache(model, 80), KVCache(model, 80), KVCache(model, 80)
    ca.extend(model, a[:50])
    cb.extend(model, b[:32])
    together = model.forward_batch([a[50:], b[32:], c], CacheBatch([ca, cb, cc]))
    for tokens, got in zip((a, b, c), together, strict=True):
        alone = KVCache(model, 80).extend(model, tokens)
        assert torch.allclose(got, alone, atol=ATOL)
    assert (ca.length, cb.length, cc.length) == (70, 33, 5)


def test_paged_kv_equals_a_contiguous_cache(model: TinyTransformer) -> None:
    """The engines' paged HBM (scattered pages, hooks per layer) gives the same logits."""
    block = 16
    pool = HbmPool(64 * TINY.num_layers, block, TINY.num_kv_heads, TINY.head_dim)
    prompts = [_tokens(40, 21), _tokens(17, 22)]
    tables = [[pool.alloc(4) or [] for _ in prompts] for _ in range(TINY.num_layers)]
    calls: list[tuple[str, int]] = []
    kv = PagedKV(pool, lambda layer: tables[layer], [0, 0],
                 before=lambda layer: calls.append(("before", layer)),
                 after=lambda layer: calls.append(("after", layer)))  # fmt: skip
    paged = model.forward_batch(prompts, kv)
    ref = model.forward_batch(prompts, CacheBatch([KVCache(model, 64), KVCache(model, 64)]))
    assert torch.allclose(paged, ref, atol=ATOL)
    assert calls == [(w, layer) for layer in range(TINY.num_layers) for w in ("before", "after")]
    # a decode step over the pages continues both sequences like the cache does
    step = model.forward_batch([[1], [2]], PagedKV(pool, lambda layer: tables[layer], [40, 17]))
    c0, c1 = KVCache(model, 64), KVCache(model, 64)
    c0.extend(model, prompts[0])
    c1.extend(model, prompts[1])
    assert torch.allclose(step, model.forward_batch([[1], [2]], CacheBatch([c0, c1])), atol=ATOL)
