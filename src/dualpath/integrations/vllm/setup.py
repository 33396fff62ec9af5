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
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dualpath.integrations.vllm.node import NodeSpec
from dualpath.net import free_port

KV_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"


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


def kv_namespace(
    weights_digest: str, shape: ModelShape, block_tokens: int, engine: str, tenant: str = ""
) -> str:
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
    block_tokens: int = 32  # vLLM's CPU attention takes multiples of 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1  # per instance (VLLM_CPU_KVCACHE_SPACE)
    buffer_mib: int = 64  # per node buffer
    snic_bytes_per_s: float = 0.0  # emulated SNIC per node; 0: unpaced
    vllm_python: str | None = None
    device: str = "cpu"
    startup_timeout_s: float = 300.0
    graceful_s: float = 5.0
    log_dir: str | None = None  # each process's log; default: a temporary directory
    extra_vllm_args: tuple[str, ...] = ()
    first_port: int = 0  # instances on first_port, first_port + 1, …; 0: free ports
    read_side: str = "policy"  # or "pe" / "de": every read from that side (tests, diagnosis)
    tool_parser: str = ""  # vLLM's --tool-call-parser of every instance ('' none)
    reasoning_parser: str = ""  # vLLM's --reasoning-parser of every instance ('' none)
    seed: int = 0  # vLLM's --seed (its default: 0)
    max_restarts: int = 3  # per process; one more death: the deployment exits non-zero
    cluster: str = ""  # place the nodes on ``dualpath cluster up``'s namespaces ("": this host)
    store_url: str = ""  # the KV store (``kv.stores.open_store``); "": the files at kv_root
    store_mib: int = 512  # ``store_url`` "mooncake": the memory of the store server started

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "max_model_len", "kv_cache_gib", "buffer_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.block_tokens < 32 or self.block_tokens % 32:
            raise ValueError(
                f"block_tokens={self.block_tokens} is invalid: vLLM needs a multiple of 32"
            )
        if self.read_side not in ("policy", "pe", "de"):
            raise ValueError(f"read_side={self.read_side!r} is invalid: must be policy, pe or de")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is invalid: must be cpu or cuda")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} is invalid: must be >= 0")
        if self.cluster and self.snic_bytes_per_s:
            raise ValueError(
                "--snic-mb-per-s is invalid with --cluster: the kernel shapes a "
                "cluster's SNICs (dualpath cluster up --snic-mbit)"
            )


def core_masks(num_instances: int, num_cores: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance: the cores split evenly (``"0"``, ``"1-3"``),
    or ``"nobind"`` each when there are more instances than cores."""
    if num_instances > num_cores:
        return ["nobind"] * num_instances
    per = num_cores // num_instances
    return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i) for i in range(num_instances)]


def plan(opts: VllmOptions, weights_digest: str, run_dir: Path, engine: str) -> Deployment:
    """The nodes and instances ``opts`` asks for (ports chosen, nothing started). A buffer
    that cannot hold a prompt of ``max_model_len`` tokens is a ValueError naming both."""
    shape = ModelShape.from_checkpoint(opts.model_dir, opts.dtype)
    full_block = shape.num_layers * opts.block_tokens * shape.row_bytes
    num_slots = max(1, opts.buffer_mib * 2**20 // full_block)
    need = -(-opts.max_model_len // opts.block_tokens)  # a longest prompt's DE slots
    if num_slots < need:
        raise ValueError(
            f"--vllm-buffer-mib {opts.buffer_mib} holds {num_slots * opts.block_tokens} tokens "
            f"of this model, less than --vllm-max-model-len {opts.max_model_len}: give at least "
            f"--vllm-buffer-mib {-(-need * full_block // 2**20)} or a shorter max model length"
        )
    seats = placement(opts)
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
                SIDECAR_PORT if seat.cnic else 0,
                seat.snic,
                opts.store_url,
            )
        )
        instances.append(Instance(node, kind, f"http://{seat.cnic or '127.0.0.1'}:{port}"))
    kv_tokens = opts.kv_cache_gib * 2**30 // (shape.num_layers * shape.row_bytes)
    dep = Deployment(
        tuple(nodes),
        tuple(instances),
        Path(opts.model_dir).name or "model",
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
        str(opts.block_tokens),
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
        *opts.extra_vllm_args,
    ]


def vllm_env(opts: VllmOptions, mask: str) -> dict[str, str]:
    """The environment of a vLLM instance: our package importable, its CPU share."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3])  # the directory holding `dualpath`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    if opts.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = mask
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def auto_tool_parser(model_dir: str | Path) -> str:
    """vLLM's ``--tool-call-parser`` for the checkpoint: the tool-call format its chat template
    teaches (``tool_families.tool_parser_for``: hermes, llama3_json, mistral, deepseek_v3,
    qwen3_coder, the names vLLM gives them too), hermes when it cannot be told."""
    from dualpath.serve.tool_families import tool_parser_for

    root = Path(model_dir)
    template, model_type = "", ""
    with contextlib.suppress(OSError, ValueError):
        model_type = str(json.loads((root / "config.json").read_text()).get("model_type", ""))
    with contextlib.suppress(OSError, ValueError, ImportError):
        from dualpath.serve.tokenizer import HFTokenizer

        template = HFTokenizer.from_dir(root).chat_template
    return tool_parser_for(template, model_type)


def check_parser(flag: str, name: str, accepted: list[str], engine: str) -> None:
    """A one-line ValueError when vLLM (``engine``) has no parser ``name`` for ``flag``."""
    if name and name not in accepted:
        raise ValueError(
            f"{flag} {name!r} is not a parser of {engine}: must be one of "
            f"{', '.join(sorted(accepted))}"
        )
