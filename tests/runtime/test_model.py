"""The runtime model: batched layerwise forward over a cached prefix equals full recompute."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dualpath.config import MODEL_PRESETS  # noqa: E402
from dualpath.runtime.attention import SdpaAttention, backend  # noqa: E402
from dualpath.runtime.hbm import HbmPool, PagedKV  # noqa: E402
from dualpath.runtime.model import CacheBatch, KVCache, greedy_generate  # noqa: E402
from dualpath.runtime.tiny import TinyTransformer, tiny_weights  # noqa: E402

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
    kv = PagedKV(
        pool,
        lambda layer: tables[layer],
        [0, 0],
        before=lambda layer: calls.append(("before", layer)),
        after=lambda layer: calls.append(("after", layer)),
    )
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


def test_the_tiny_model_is_a_transformers_llama(tmp_path: Path) -> None:
    """The one forward: the tiny model's seeded weights, saved as a Llama checkpoint, give
    transformers' ``LlamaForCausalLM`` the logits our forward gives, at every position."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    model = TinyTransformer(TINY, seed=5)
    spec = model.spec
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    save_file(
        {k: v.contiguous() for k, v in tiny_weights(TINY, 5).items()},
        str(tmp_path / "model.safetensors"),
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    prompt = _tokens(96, seed=2)
    with torch.no_grad():
        want = ref.eval()(torch.tensor([prompt])).logits[0]
    cache = KVCache(model, 96)
    got = torch.stack([cache.extend(model, [t]) for t in prompt])
    assert torch.allclose(got, want, atol=ATOL)
    assert want.std() > 0.1


def test_attention_is_a_backend_chosen_by_name() -> None:
    assert backend("sdpa").name == "sdpa"
    assert isinstance(TinyTransformer(TINY, seed=0).attention, SdpaAttention)
    with pytest.raises(
        ValueError, match="attention backend 'flash' is unknown: must be one of sdpa"
    ):
        backend("flash")
