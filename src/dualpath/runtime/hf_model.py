"""The runtime's one model forward: Llama / Qwen2 / Qwen3 (HF layout), layerwise and batched.

``HFTransformer`` runs Hugging Face-format checkpoints and the built-in tiny model alike (the
tiny model is a Llama whose weights come from a seed: ``tiny.TinyTransformer``); attention is
an ``attention.AttentionBackend`` (SDPA by default).

Reads ``config.json`` + ``*.safetensors`` from a local directory (no hub access). The weights are
memory-mapped (``load_safetensors``: the file's pages are shared by every engine process that
maps it, copy-on-write), so N engines on one host hold one copy in the page cache, not N
private ones, as long as the checkpoint's dtype is the compute dtype (else each converts its own
copy). ``HFTransformer`` implements ``model.RuntimeModel``: batched layerwise forward over a
``BatchKV``; Qwen3's per-head q/k RMSNorm included. No clock; the only I/O is loading
(``runtime/weights.py`` reads the files).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dualpath.config import Config, ModelConfig
from dualpath.runtime.attention import AttentionBackend, SdpaAttention
from dualpath.runtime.model import BatchKV, HiddenHook, kv_row_bytes, last_rows, positions
from dualpath.runtime.weights import load_safetensors

SUPPORTED_TYPES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SUPPORTED_ROPE = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class HFSpec:
    """The architecture fields of a Llama / Qwen2 / Qwen3 ``config.json`` the forward uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"config.json model_type={self.model_type!r} is not supported: "
                f"must be one of {', '.join(SUPPORTED_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json num_attention_heads={self.num_heads} is invalid: must be a "
                f"multiple of num_key_value_heads={self.num_kv_heads}"
            )
        rope_type = dict(self.rope_scaling).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE:
            raise ValueError(
                f"config.json rope_type={rope_type!r} is not supported: "
                f"must be one of {', '.join(SUPPORTED_ROPE)}"
            )

    @property
    def qk_norm(self) -> bool:
        """Qwen3: RMSNorm over each head of q and k before RoPE."""
        return self.model_type == "qwen3"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFSpec:
        """From ``model_dir/config.json``; ValueError (one line) naming what is wrong."""
        root = Path(model_dir)
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"--model-dir {root}: no config.json there")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path}: must be a JSON object")
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HFSpec:
        """From a parsed ``config.json`` (transformers 4 or 5 layout of the RoPE fields)."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            model_type = str(cfg.get("model_type", ""))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                # Qwen2 always has q/k/v biases; Llama / Qwen3 have them when attention_bias is set
                attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                rope_scaling=tuple(sorted(rope.items())),
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing field {exc.args[0]!r}") from None


def rope_inv_freq(spec: HFSpec) -> Tensor:
    """Inverse RoPE frequencies [head_dim/2]: plain, or Llama 3.1's frequency-band scaling."""
    d = spec.head_dim
    inv = 1.0 / spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    params = dict(spec.rope_scaling)
    if params.get("rope_type", "default") != "llama3":
        return inv
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: Tensor
    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    bq: Tensor | None
    bk: Tensor | None
    bv: Tensor | None
    q_norm: Tensor | None  # Qwen3: per-head RMSNorm weights [head_dim]
    k_norm: Tensor | None
    mlp_norm: Tensor
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    b_gate: Tensor | None
    b_up: Tensor | None
    b_down: Tensor | None


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, w, b)


class HFTransformer:
    """Our forward over HF Llama / Qwen2 / Qwen3 weights (names as ``*ForCausalLM`` saves
    them); a ``model.RuntimeModel``."""

    def __init__(
        self,
        spec: HFSpec,
        weights: dict[str, Tensor],
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "hf",
        attention: AttentionBackend | None = None,
    ) -> None:
        self.spec = spec
        self.attention = attention if attention is not None else SdpaAttention()
        self.name = name
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = spec.num_layers
        self.hidden_size = spec.hidden_size
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.vocab_size = spec.vocab_size
        self.max_context_tokens = spec.max_position_embeddings
        self.eos_token_ids = spec.eos_token_ids

        def get(key: str, required: bool = True) -> Tensor | None:
            t = weights.get(key)
            if t is None:
                if required:
                    raise ValueError(f"checkpoint is missing tensor {key!r}")
                return None
            return t.to(device=self.device, dtype=dtype)  # no copy when both already match

        def req(key: str) -> Tensor:
            t = get(key)
            assert t is not None
            return t

        self.embedding = req("model.embed_tokens.weight")
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            ab, mb, qk = spec.attention_bias, spec.mlp_bias, spec.qk_norm
            self.layers.append(
                _Layer(
                    attn_norm=req(p + "input_layernorm.weight"),
                    wq=req(p + "self_attn.q_proj.weight"),
                    wk=req(p + "self_attn.k_proj.weight"),
                    wv=req(p + "self_attn.v_proj.weight"),
                    wo=req(p + "self_attn.o_proj.weight"),
                    bq=get(p + "self_attn.q_proj.bias", ab),
                    bk=get(p + "self_attn.k_proj.bias", ab),
                    bv=get(p + "self_attn.v_proj.bias", ab),
                    q_norm=get(p + "self_attn.q_norm.weight", qk) if qk else None,
                    k_norm=get(p + "self_attn.k_norm.weight", qk) if qk else None,
                    mlp_norm=req(p + "post_attention_layernorm.weight"),
                    w_gate=req(p + "mlp.gate_proj.weight"),
                    w_up=req(p + "mlp.up_proj.weight"),
                    w_down=req(p + "mlp.down_proj.weight"),
                    b_gate=get(p + "mlp.gate_proj.bias", mb),
                    b_up=get(p + "mlp.up_proj.bias", mb),
                    b_down=get(p + "mlp.down_proj.bias", mb),
                )
            )
        self.final_norm = req("model.norm.weight")
        head = get("lm_head.weight", required=not spec.tie_word_embeddings)
        self.lm_head = self.embedding if head is None else head
        self._inv_freq = rope_inv_freq(spec).to(self.device)

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> HFTransformer:
        """Load ``config.json`` and every ``*.safetensors`` shard of a local checkpoint
        (memory-mapped, see ``load_safetensors``)."""
        root = Path(model_dir)
        spec = HFSpec.from_dir(root)
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"--model-dir {root}: no *.safetensors weights there")
        weights: dict[str, Tensor] = {}
        for shard in shards:
            weights.update(load_safetensors(shard))
        return cls(spec, weights, device=device, dtype=dtype, name=root.name)

    @property
    def kv_row_bytes(self) -> int:
        return kv_row_bytes(self)

    def tensors(self) -> list[Tensor]:
        """Every weight tensor, in a fixed order (the tiny model's weight digest)."""
        out = [self.embedding, self.final_norm, self.lm_head]
        for layer in self.layers:
            out.extend(
                t for f in layer.__dataclass_fields__ if (t := getattr(layer, f)) is not None
            )
        return out

    def _rope_table(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin ``[N, 1, head_dim]`` of the new tokens' positions (once per forward)."""
        angles = pos.to(self._inv_freq.dtype).unsqueeze(1) * self._inv_freq.unsqueeze(0)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(self.dtype).unsqueeze(1), emb.sin().to(self.dtype).unsqueeze(1)

    @staticmethod
    def _rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        # x: [N, heads, head_dim]; HF layout: rotate the two halves (rotate_half)
        cos, sin = rope
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _layer(
        self,
        layer: int,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        kv: BatchKV,
        lens: Sequence[int],
    ) -> Tensor:
        w = self.layers[layer]
        n = h.shape[0]
        x = self._norm(h, w.attn_norm)
        q = _linear(x, w.wq, w.bq).view(n, self.num_heads, self.head_dim)
        k = _linear(x, w.wk, w.bk).view(n, self.num_kv_heads, self.head_dim)
        v = _linear(x, w.wv, w.bv).view(n, self.num_kv_heads, self.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        q, k = self._rope(q, rope), self._rope(k, rope)
        full = kv.update(layer, torch.stack((k, v), dim=1), lens).to(self.device, self.dtype)
        h = h + _linear(self.attention.attend(q, full, kv.past_lens, lens), w.wo, None)
        x = self._norm(h, w.mlp_norm)
        gate = torch.nn.functional.silu(_linear(x, w.w_gate, w.b_gate))
        return h + _linear(gate * _linear(x, w.w_up, w.b_up), w.w_down, w.b_down)

    @torch.no_grad()
    def forward_batch(
        self,
        new_tokens: Sequence[Sequence[int]],
        kv: BatchKV,
        on_hidden: HiddenHook | None = None,
    ) -> Tensor:
        """Batched layerwise forward (``model.RuntimeModel``): logits of each sequence's last
        new token, ``[B, vocab]`` float32 on the CPU."""
        lens = [len(t) for t in new_tokens]
        if not lens or min(lens) < 1:
            raise ValueError(f"forward_batch needs >= 1 new token per sequence (got {lens})")
        rope = self._rope_table(positions(kv.past_lens, lens).to(self.device))
        ids = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long)
        h = self.embedding[ids.to(self.device)]
        for layer in range(self.num_layers):
            h = self._layer(layer, h, rope, kv, lens)
            if on_hidden is not None:
                on_hidden(layer, h)
        h_last = self._norm(h[last_rows(lens).to(self.device)], self.final_norm)
        return (h_last @ self.lm_head.T).float().cpu()


def model_config(spec: HFSpec, dtype: str, name: str) -> ModelConfig:
    """The runtime's ``ModelConfig`` of a checkpoint (what the scheduler, buffers, store and
    cost model size by): dense GQA, KV in the compute ``dtype``."""
    itemsize = DTYPES[dtype].itemsize
    embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    attn = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    per_layer = attn + 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size
    params = float(embed + spec.num_layers * per_layer)
    return ModelConfig(
        name=name,
        attention="gqa",
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        kv_dtype_bytes=itemsize,
        active_params=params,
        total_params=params,
        num_routed_experts=0,
        experts_per_token=0,
        num_shared_experts=0,
        num_dense_layers=spec.num_layers,
        ffn_hidden_size=spec.intermediate_size,
        moe_intermediate_size=0,
        vocab_size=spec.vocab_size,
        max_context_tokens=spec.max_position_embeddings,
        compute_dtype="bf16",
        weight_dtype_bytes=float(itemsize),
    )


def with_checkpoint(config: Config, model_dir: str, dtype: str = "float32") -> Config:
    """``config`` with its model replaced by ``model_dir``'s (``model_config``)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"--model-dir {model_dir}: no such directory")
    spec = HFSpec.from_dir(root)
    if not any(root.glob("*.safetensors")):
        raise ValueError(f"--model-dir {root}: no *.safetensors weights there")
    model = model_config(spec, dtype, root.resolve().name)
    return replace(config, model=model)
