"""Our layerwise forward on tiny random HF checkpoints equals transformers' (logits, greedy);
the weights are memory-mapped views of the safetensors files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dualpath.frontend.checkpoint import write_tiny_checkpoint  # noqa: E402
from dualpath.runtime.hf_model import HFSpec, HFTransformer, model_config  # noqa: E402
from dualpath.runtime.model import CacheBatch, KVCache  # noqa: E402
from dualpath.runtime.weights import load_safetensors  # noqa: E402

ATOL = 1e-4  # float32; different kernels and matmul shapes


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param)


def _reference(path: Path):  # type: ignore[no-untyped-def]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return ref.eval()


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_logits_match_transformers_at_every_position(ckpt: Path) -> None:
    ours, ref = HFTransformer.from_dir(ckpt), _reference(ckpt)
    prompt = _tokens(ours.vocab_size, 40, seed=1)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    seq = KVCache(ours, 64)
    for i, tok in enumerate(prompt):  # one token at a time: the KV cache path
        got = seq.extend(ours, [tok])
        assert torch.allclose(got, ref_logits[i], atol=ATOL), f"position {i}"
    assert ref_logits.std() > 0.1  # the random weights give logits that differ


@pytest.mark.parametrize("cached", [0, 16, 33])
def test_cached_prefix_plus_new_tokens_equals_full_prefill(ckpt: Path, cached: int) -> None:
    ours, ref = HFTransformer.from_dir(ckpt), _reference(ckpt)
    prompt = _tokens(ours.vocab_size, 48, seed=cached)
    with torch.no_grad():
        ref_last = ref(torch.tensor([prompt])).logits[0, -1]
    full = KVCache(ours, 48)
    full.extend(ours, prompt)
    part = KVCache(ours, 48)
    for layer in range(ours.num_layers):  # KV "loaded" for the cached prefix
        part.layers[layer][:cached] = full.past(layer)[:cached]
    part.length = cached
    seen: list[int] = []
    logits = ours.forward_batch(
        [prompt[cached:]], CacheBatch([part]), lambda layer, h: seen.append(h.shape[0])
    )[0]
    assert seen == [48 - cached] * ours.num_layers
    assert torch.allclose(logits, ref_last, atol=ATOL)


def test_greedy_tokens_match_transformers_generate(ckpt: Path) -> None:
    ours, ref = HFTransformer.from_dir(ckpt), _reference(ckpt)
    prompt = _tokens(ours.vocab_size, 20, seed=5)
    ref.generation_config.eos_token_id = None  # run 16 tokens (min_new_tokens masks EOS)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    expected = out[0, len(prompt) :].tolist()
    seq = KVCache(ours, 64)
    got = [int(seq.extend(ours, prompt).argmax())]
    while len(got) < 16:
        got.append(int(seq.extend(ours, got[-1:]).argmax()))
    assert got == expected
    assert len(set(got)) > 1


def test_batched_step_equals_separate_sequences(ckpt: Path) -> None:
    ours = HFTransformer.from_dir(ckpt)
    a, b = _tokens(ours.vocab_size, 30, 7), _tokens(ours.vocab_size, 11, 8)
    sa, sb = KVCache(ours, 40), KVCache(ours, 40)
    sa.extend(ours, a[:20])
    together = ours.forward_batch([a[20:], b], CacheBatch([sa, sb]))  # a: continuation, b: fresh
    assert torch.allclose(together[0], KVCache(ours, 40).extend(ours, a), atol=ATOL)
    assert torch.allclose(together[1], KVCache(ours, 40).extend(ours, b), atol=ATOL)
    assert sa.length == 30 and sb.length == 11


def test_bad_checkpoints_are_one_line_errors(tmp_path: Path, ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        HFTransformer.from_dir(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        HFSpec.from_config({**cfg, "model_type": "gpt2"})
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        HFSpec.from_config(cfg)


def test_llama3_rope_scaling_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dualpath.runtime.hf_model import rope_inv_freq

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=2, rope_parameters=params
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    spec = HFSpec.from_config(cfg.to_dict())
    assert torch.allclose(rope_inv_freq(spec), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_forward_matches_cpu(ckpt: Path) -> None:
    cpu, gpu = HFTransformer.from_dir(ckpt), HFTransformer.from_dir(ckpt, device="cuda")
    prompt = _tokens(cpu.vocab_size, 32, seed=3)
    a = KVCache(cpu, 40).extend(cpu, prompt)
    b = KVCache(gpu, 40).extend(gpu, prompt)
    assert gpu.layers[0].wq.device.type == "cuda"
    assert torch.allclose(a, b, atol=1e-3)


def test_weights_are_views_of_the_memory_mapped_file(ckpt: Path) -> None:
    """Zero-copy: the model's tensors point into the mapping of model.safetensors, so engine
    processes share the file's pages instead of holding private copies."""
    weights = load_safetensors(ckpt / "model.safetensors")
    ours = HFTransformer(HFSpec.from_dir(ckpt), weights)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert ours.layers[0].wq.data_ptr() == weights[key].data_ptr()
    ref = _reference(ckpt).state_dict()
    assert all(torch.equal(weights[k], ref[k]) for k in weights)


def test_corrupt_safetensors_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_safetensors(bad)


def test_model_config_sizes_the_runtime_kv(ckpt: Path) -> None:
    spec = HFSpec.from_dir(ckpt)
    m = model_config(spec, "bfloat16", "x")
    assert m.kv_bytes_per_token_per_layer == 2 * spec.num_kv_heads * spec.head_dim * 2
    ours = HFTransformer(spec, load_safetensors(ckpt / "model.safetensors"), dtype=torch.bfloat16)
    assert ours.kv_row_bytes == m.kv_bytes_per_token_per_layer
    assert m.num_layers == spec.num_layers and m.vocab_size == spec.vocab_size
