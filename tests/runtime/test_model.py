"""The runtime model: layerwise prefill over a cached prefix equals full recompute."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from dualpath.config import MODEL_PRESETS  # noqa: E402
from dualpath.runtime.model import KVCache, TinyTransformer  # noqa: E402

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
    assert model.empty_kv(3).numel() * 4 == 3 * TINY.kv_bytes_per_token_per_layer


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
    logits = model.prefill(prompt[cached:], part.past, lambda layer, kv: seen.append(layer) or None)
    assert seen == list(range(TINY.num_layers))
    assert torch.allclose(logits, ref_logits, atol=ATOL)
    assert int(logits.argmax()) == int(ref_logits.argmax())
    if cached:
        for layer in range(TINY.num_layers):
            assert torch.allclose(part.past(layer), full.past(layer)[:cached], atol=ATOL)


def test_greedy_continuation_from_cached_kv_matches_generate(model: TinyTransformer) -> None:
    prompt = _tokens(150, seed=1)
    ref, ref_cache = model.generate(prompt, 12)
    assert ref_cache.length == 150 + 11
    cache = KVCache(model, 200)
    for layer in range(TINY.num_layers):  # KV as if loaded from storage for the first 128
        cache.put(layer, 0, ref_cache.past(layer)[:128])
    cache.length = 128
    out = [int(cache.extend(model, prompt[128:]).argmax())]
    while len(out) < 12:
        out.append(int(cache.extend(model, out[-1:]).argmax()))
    assert out == ref
    assert len(set(ref)) > 1  # the weights do not collapse to one token


def test_prefill_rejects_empty_and_non_gqa() -> None:
    m = TinyTransformer(TINY, seed=0)
    with pytest.raises(ValueError, match="at least one new token"):
        m.prefill([], lambda layer: m.empty_kv())
    with pytest.raises(ValueError, match=r"model\.attention"):
        TinyTransformer(MODEL_PRESETS["ds27b"])
