"""Build a tiny random Hugging Face checkpoint and tokenizer on local disk (no hub access).

Used by tests, demos and ``benchmarks/bench_serve.py``: ``transformers`` builds a random
Llama / Qwen2 / Qwen3 model from a small config and saves it with ``save_pretrained`` (config.json +
model.safetensors); ``tokenizers`` trains a byte-level BPE on a few strings. Needs the
``serve`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dualpath.frontend.tokenizer import DEFAULT_CHAT_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# transformers' config / model class prefixes below; deepseek_v3 (MLA + MoE) and gemma3
# (sliding-window + full attention) are the shapes `serve --engine vllm` is tested on
ARCHS = ("llama", "qwen2", "qwen3", "deepseek_v3", "gemma3")
_CLASSES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "deepseek_v3": "DeepseekV3",
    "gemma3": "Gemma3",
}


def _family_config(arch: str, common: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The config of ``arch`` beyond ``common`` and the config class's name."""
    if arch == "deepseek_v3":
        # MLA (the 576-wide latent vLLM's CPU MLA backends take: 512 + 64 rope) + a small
        # MoE after one dense layer; vLLM loads the router's correction bias only with
        # noaux_tc (a KeyError on ...gate.e_score_correction_bias otherwise)
        heads = common["num_attention_heads"]
        return {
            **common,
            "num_key_value_heads": heads,
            "q_lora_rank": 128,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "head_dim": 64,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": common["intermediate_size"] // 2,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_scaling": None,
        }, "DeepseekV3Config"
    if arch == "gemma3":
        # sliding-window layers of a 64-token window and a full-attention layer every 4th:
        # vLLM's hybrid KV cache manager (one group per layer kind and position)
        return {
            **common,
            "sliding_window": 64,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                for i in range(common["num_hidden_layers"])
            ],
            "query_pre_attn_scalar": common["head_dim"],
        }, "Gemma3TextConfig"
    return common, f"{_CLASSES[arch]}Config"


_CORPUS = (
    "You are a helpful coding agent. Read the file, run the tests, fix the bug.",
    "The user asked for a summary of the repository layout and the failing test.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Tool call: ls -la src/ && cat README.md | head -40",
    "DualPath loads KV cache through the decode engines' storage NICs as well.",
    "Observation: 3 passed, 1 failed in 0.52s. The assertion compares two lists.",
)


def write_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on a few strings; write tokenizer.json + tokenizer_config.json.

    Returns the vocabulary size actually reached (≤ ``vocab_size``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": DEFAULT_CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(tok.get_vocab_size())


def write_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
) -> Path:
    """Write a random ``arch`` (one of ``ARCHS``) checkpoint + tokenizer to ``out_dir``."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is invalid: must be one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    vocab = write_tokenizer(out)
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    # initializer_range larger than the default so logits are not all ~equal
    common["initializer_range"] = 0.2
    common["head_dim"] = hidden_size // num_heads  # Qwen3's default (128) is not derived
    prefix = _CLASSES[arch]
    cfg, config_name = _family_config(arch, common)
    config_cls = getattr(transformers, config_name)
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    model: Any
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**cfg))
        for layer in model.model.layers:  # make what differs per family matter in comparisons
            attn = layer.self_attn
            if arch == "qwen2":  # biases start at zero
                for proj in (attn.q_proj, attn.k_proj):
                    torch.nn.init.normal_(proj.bias, std=0.2)
            if arch == "qwen3":  # q/k norms start at one
                for norm in (attn.q_norm, attn.k_norm):
                    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    model.save_pretrained(str(out))
    if arch == "deepseek_v3":  # what vLLM reads to build the MoE router (see above)
        path = out / "config.json"
        saved = json.loads(path.read_text())
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
        path.write_text(json.dumps(saved, indent=2))
    return out
