"""A Hugging Face-format Llama / Qwen2 checkpoint run by our own layerwise forward.

Loads ``config.json`` + ``*.safetensors`` from a local directory (no hub access) and exposes
the same per-layer interface as ``TinyTransformer`` (``layer_forward``, ``prefill(new_tokens,
get_past, on_layer)``, ``logits``, ``empty_kv``): a layer's KV for T tokens is one tensor
``[T, 2, kv_heads, head_dim]``, so the runtime can swap models. ``forward_batch`` runs several
sequences' new tokens through one set of GEMMs (continuous batching); attention stays per
sequence. No clock; the only I/O is ``from_dir``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dualpath.runtime.model import LayerHook, PastFn, run_layers

SUPPORTED_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class HFSpec:
    """The architecture fields of a Llama / Qwen2 ``config.json`` that the forward uses."""

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
                # Qwen2 always has q/k/v biases; Llama has them when attention_bias is set
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


@dataclass(slots=True)
class SequenceKV:
    """One sequence's preallocated per-layer KV, ``[capacity, 2, kv_heads, head_dim]`` each."""

    layers: list[Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[0] if self.layers else 0

    def past(self, layer: int) -> Tensor:
        return self.layers[layer][: self.length]

    def put(self, layer: int, start: int, kv: Tensor) -> None:
        self.layers[layer][start : start + kv.shape[0]] = kv


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
    """Our forward over HF Llama / Qwen2 weights (names as ``LlamaForCausalLM`` saves them)."""

    def __init__(
        self,
        spec: HFSpec,
        weights: dict[str, Tensor],
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "hf",
    ) -> None:
        self.spec = spec
        self.name = name
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = spec.num_layers
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.vocab_size = spec.vocab_size
        self.max_context_tokens = spec.max_position_embeddings

        def get(key: str, required: bool = True) -> Tensor | None:
            t = weights.get(key)
            if t is None:
                if required:
                    raise ValueError(f"checkpoint is missing tensor {key!r}")
                return None
            return t.to(device=self.device, dtype=dtype)

        def req(key: str) -> Tensor:
            if key not in weights:
                raise ValueError(f"checkpoint is missing tensor {key!r}")
            return weights[key].to(device=self.device, dtype=dtype)

        self.embedding = req("model.embed_tokens.weight")
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            ab, mb = spec.attention_bias, spec.mlp_bias
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
        """Load ``config.json`` and every ``*.safetensors`` shard of a local checkpoint."""
        from safetensors.torch import load_file

        root = Path(model_dir)
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"--model-dir {root}: no config.json there")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise ValueError(f"--model-dir {root}: no *.safetensors weights there")
        weights: dict[str, Tensor] = {}
        for shard in shards:
            weights.update(load_file(str(shard)))
        return cls(HFSpec.from_config(cfg), weights, device=device, dtype=dtype, name=root.name)

    # -- the per-layer interface shared with TinyTransformer ------------------------------

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's KV in one layer (a Layer Block row)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def empty_kv(self, num_tokens: int = 0) -> Tensor:
        return torch.zeros(
            num_tokens, 2, self.num_kv_heads, self.head_dim, device=self.device, dtype=self.dtype
        )

    def new_sequence(self, capacity_tokens: int) -> SequenceKV:
        return SequenceKV([self.empty_kv(capacity_tokens) for _ in range(self.num_layers)])

    def embed(self, tokens: Sequence[int]) -> Tensor:
        return self.embedding[torch.tensor(list(tokens), dtype=torch.long, device=self.device)]

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        # x: [T, heads, head_dim]; HF layout: rotate the two halves (rotate_half)
        angles = positions.to(self._inv_freq.dtype).unsqueeze(1) * self._inv_freq.unsqueeze(0)
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _qkv(self, layer: int, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w = self.layers[layer]
        t = h.shape[0]
        x = self._norm(h, w.attn_norm)
        q = _linear(x, w.wq, w.bq).view(t, self.num_heads, self.head_dim)
        k = _linear(x, w.wk, w.bk).view(t, self.num_kv_heads, self.head_dim)
        v = _linear(x, w.wv, w.bv).view(t, self.num_kv_heads, self.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q: Tensor, kv: Tensor, past_len: int) -> Tensor:
        """Causal attention of new queries q [T, H, hd] over kv [P+T, 2, kvh, hd] → [T, H*hd]."""
        t = q.shape[0]
        rep = self.num_heads // self.num_kv_heads
        keys = kv[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)
        vals = kv[:, 1].repeat_interleave(rep, dim=1).transpose(0, 1)
        mask = None
        if t > 1:
            total = past_len + t
            pos = torch.arange(total, device=q.device)
            mask = pos.unsqueeze(0) <= (pos[past_len:]).unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys, vals, attn_mask=mask
        )
        return out.transpose(0, 1).reshape(t, -1)

    def _mlp(self, layer: int, h: Tensor) -> Tensor:
        w = self.layers[layer]
        x = self._norm(h, w.mlp_norm)
        gate = torch.nn.functional.silu(_linear(x, w.w_gate, w.b_gate))
        return h + _linear(gate * _linear(x, w.w_up, w.b_up), w.w_down, w.b_down)

    def layer_forward(self, layer: int, h: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        """One layer over new hidden states ``h`` [T, hidden] after ``past`` [P, 2, kvh, hd].

        Returns (new hidden states, KV of the new tokens [T, 2, kvh, hd])."""
        p = past.shape[0]
        positions = torch.arange(p, p + h.shape[0], device=self.device)
        q, k, v = self._qkv(layer, h, positions)
        new_kv = torch.stack((k, v), dim=1)
        kv = torch.cat((past, new_kv), dim=0) if p else new_kv
        h = h + _linear(self._attend(q, kv, p), self.layers[layer].wo, None)
        return self._mlp(layer, h), new_kv

    def logits(self, h_last: Tensor) -> Tensor:
        return (self._norm(h_last, self.final_norm) @ self.lm_head.T).float()

    @torch.no_grad()
    def prefill(
        self, new_tokens: Sequence[int], get_past: PastFn, on_layer: LayerHook | None = None
    ) -> Tensor:
        """Layerwise prefill of ``new_tokens`` after a cached prefix; returns the last logits
        (same contract as ``TinyTransformer.prefill``)."""
        if not new_tokens:
            raise ValueError("prefill needs at least one new token (got 0)")
        h = self.embed(new_tokens)
        return self.logits(run_layers(self, h, get_past, on_layer)[-1])

    # -- batched steps (continuous batching) ----------------------------------------------

    @torch.no_grad()
    def forward_batch(self, items: Sequence[tuple[Sequence[int], SequenceKV]]) -> Tensor:
        """Run each sequence's new tokens after its cached ``length`` in one pass.

        Projections and MLPs run on all new tokens at once; attention per sequence. Each
        sequence's KV is written at ``[length, length + T)`` and ``length`` advances.
        Returns the logits of each sequence's last new token, ``[len(items), vocab]``."""
        if not items or any(not toks for toks, _ in items):
            raise ValueError("forward_batch needs at least one new token per sequence")
        lens = [len(toks) for toks, _ in items]
        for (_, seq), n in zip(items, lens, strict=True):
            if seq.length + n > seq.capacity:
                raise ValueError(
                    f"sequence of {seq.length} + {n} tokens exceeds its KV capacity {seq.capacity}"
                )
        ids = [t for toks, _ in items for t in toks]
        positions = torch.cat(
            [
                torch.arange(seq.length, seq.length + n)
                for (_, seq), n in zip(items, lens, strict=True)
            ]
        ).to(self.device)
        h = self.embed(ids)
        for layer in range(self.num_layers):
            q, k, v = self._qkv(layer, h, positions)
            new_kv = torch.stack((k, v), dim=1)
            outs, start = [], 0
            for (_, seq), n in zip(items, lens, strict=True):
                seq.put(layer, seq.length, new_kv[start : start + n])
                kv = seq.layers[layer][: seq.length + n]
                outs.append(self._attend(q[start : start + n], kv, seq.length))
                start += n
            h = h + _linear(torch.cat(outs), self.layers[layer].wo, None)
            h = self._mlp(layer, h)
        for (_, seq), n in zip(items, lens, strict=True):
            seq.length += n
        last = torch.tensor(list(_last_indices(lens)), device=self.device)
        return self.logits(h[last])


def _last_indices(lens: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        total += n
        out.append(total - 1)
    return out
