"""Build the DualPath runtime behind the HTTP server from the command line's options; run it.

There is one engine: every request goes through the multi-process runtime (scheduler, storage
workers, PE and DE engine processes, the persistent KV store; ``serve/runtime_backend.py``),
on this host or as Ray actors over a cluster (``runtime="ray"``), running the preset's
built-in tiny model or a Hugging Face checkpoint (``model_dir``) on CPU or CUDA.
uvicorn handles SIGINT / SIGTERM: it stops accepting, lets in-flight requests finish for up
to ``graceful_s``, then cancels them; the app's lifespan then stops the runtime, whose
scheduler process stops its engines and unlinks the node buffers.
"""

from __future__ import annotations

import ipaddress
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.config import Config
from dualpath.config.systems import SYSTEMS
from dualpath.frontend.api import ApiOptions, create_app
from dualpath.frontend.backend import Backend
from dualpath.frontend.grammars import GrammarLimits
from dualpath.frontend.guard import ConnectionLimits
from dualpath.frontend.http_server import http_server
from dualpath.frontend.reasoning import REASONING_PARSERS
from dualpath.frontend.tool_families import TOOL_PARSERS
from dualpath.runtime.gputime import GPU_TIMES
from dualpath.runtime.options import DEVICES, DTYPES, RUNTIMES

RUNTIME_SYSTEMS = tuple(SYSTEMS)  # every system the runtime runs


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: str | None = None  # an HF checkpoint; None: the preset's built-in tiny model
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    api_keys: dict[str, str] = field(default_factory=dict)  # key → tenant
    metrics_open: bool = False  # /metrics without a key (a scraper on loopback)
    system: str = "dualpath"  # the policy (``RuntimeOptions.system``)
    kv_root: str = "./.dualpath/kv"  # the persistent KV store
    hbm_tokens: int = 65536  # each engine's paged HBM, tokens
    runtime: str = "local"  # processes on this host, or Ray actors ("ray")
    ray_address: str = ""
    transport: str = "shm"
    threads: int = 0  # torch CPU threads per engine (0: the cores shared by the engines)
    gpu_time: str = (
        "host"  # or "emulated": passes no faster than the preset's GPU (docs/runtime.md)
    )
    default_max_tokens: int = 256
    tool_parser: str = "auto"  # a TOOL_PARSERS name (frontend/tool_families.py), or auto
    reasoning_parser: str = ""  # a reasoning.REASONING_PARSERS name ('' none)
    graceful_s: float = 5.0
    request_timeout_s: float = 300.0  # every request ends by then (504 / an error event)
    log_level: str = "warning"
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # frontend/guard.py
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # frontend/grammars.py

    def __post_init__(self) -> None:
        if self.system not in RUNTIME_SYSTEMS:
            raise ValueError(
                f"--system {self.system!r} is invalid: must be one of {', '.join(RUNTIME_SYSTEMS)}"
            )
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"--device {self.device!r} is invalid: must be cpu or cuda[:N]")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"--dtype {self.dtype!r} is invalid: must be one of {', '.join(DTYPES)}"
            )
        if self.model_dir is None and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(
                "--device / --dtype: the built-in tiny model runs on cpu in float32 only "
                "(give --model-dir for a checkpoint)"
            )
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"--runtime {self.runtime!r} is invalid: must be one of {', '.join(RUNTIMES)}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is invalid: must be 0..65535")
        if self.default_max_tokens < 1:
            raise ValueError(f"default max_tokens={self.default_max_tokens} must be >= 1")
        if self.tool_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(
                f"--tool-parser {self.tool_parser!r} is invalid: must be auto or one of "
                f"{', '.join(sorted(TOOL_PARSERS))}"
            )
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} is invalid: must be one of "
                f"{', '.join(sorted(REASONING_PARSERS))}"
            )
        if self.threads < 0:
            raise ValueError(f"--threads {self.threads} is invalid: must be >= 0 (0 = auto)")
        if self.gpu_time not in GPU_TIMES:
            raise ValueError(
                f"--gpu-time {self.gpu_time!r} is invalid: must be one of {', '.join(GPU_TIMES)}"
            )
        if not self.request_timeout_s > 0:
            raise ValueError(
                f"--request-timeout-s {self.request_timeout_s} is invalid: must be > 0"
            )

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def resolve_config(config: Config, opts: ServeOptions) -> Config:
    """``config`` with the checkpoint's model (``--model-dir``), as the engines will run it."""
    if opts.model_dir is None:
        return config
    from dualpath.runtime.hf_model import with_checkpoint

    return with_checkpoint(config, opts.model_dir, opts.dtype)


def build_backend(config: Config, opts: ServeOptions) -> Backend:
    """The DualPath runtime over ``config`` (already ``resolve_config``d) with the checkpoint's
    tokenizer, or the tiny model's ``TinyTokenizer``."""
    from dualpath.frontend.tokenizer import HFTokenizer, TextTokenizer, TinyTokenizer
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.serve.runtime_backend import RuntimeBackend

    if opts.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {opts.device}: CUDA is not available on this machine")
    tokenizer: TextTokenizer
    if opts.model_dir is not None:
        from dualpath.runtime.hf_model import HFSpec

        eos = HFSpec.from_dir(opts.model_dir).eos_token_ids
        tokenizer = HFTokenizer.from_dir(opts.model_dir, extra_eos_ids=eos)
        name = Path(opts.model_dir).resolve().name
    else:
        tokenizer = TinyTokenizer(config.model.vocab_size)
        name = f"dualpath-{config.model.name}"
    options = RuntimeOptions(
        system=opts.system,
        kv_root=opts.kv_root,
        hbm_tokens=opts.hbm_tokens,
        weight_seed=opts.seed,
        model_dir=opts.model_dir or "",
        device=opts.device,
        dtype=opts.dtype,
        threads=opts.threads,
        gpu_time=opts.gpu_time,
        runtime=opts.runtime,
        ray_address=opts.ray_address,
        transport=opts.transport,
        vocab=tokenizer.vocab_spec(),
        request_timeout_s=opts.request_timeout_s,
    )
    return RuntimeBackend(config, options, tokenizer, name, seed=opts.seed)


def tool_format(backend: Backend, opts: ServeOptions) -> str:
    """``--tool-parser``, or the format the chat template teaches (auto)."""
    if opts.tool_parser != "auto":
        return opts.tool_parser
    from dualpath.frontend.tool_families import tool_parser_for

    model_type = ""
    if opts.model_dir is not None:
        import json

        cfg = Path(opts.model_dir) / "config.json"
        model_type = str(json.loads(cfg.read_text()).get("model_type", "")) if cfg.is_file() else ""
    return tool_parser_for(backend.tokenizer.chat_template, model_type)


def run_server(backend: Backend, opts: ServeOptions) -> int:
    api = ApiOptions(
        api_keys=opts.api_keys,
        metrics_open=opts.metrics_open,
        default_max_tokens=opts.default_max_tokens,
        tool_format=tool_format(backend, opts),
        reasoning_parser=opts.reasoning_parser,
        request_timeout_s=opts.request_timeout_s,
        grammar=opts.grammar,
    )
    app = create_app(backend, api)
    http = http_server(app, opts.host, opts.port, opts.log_level, opts.graceful_s, opts.limits)
    server, stopped_by = http.server, http.stopped_by
    failed: list[str] = []

    def on_failure(reason: str) -> None:
        # fail-fast: the runtime died under us; in-flight requests get a 503 / an error event,
        # then the server exits non-zero so a process manager restarts it (the KV store is
        # persistent: warm prefixes survive the restart)
        failed.append(reason)
        server.should_exit = True

    if hasattr(backend, "on_failure"):
        backend.on_failure = on_failure
    http.run()
    if failed:
        print("dualpath serve: exiting (1): the runtime failed", file=sys.stderr, flush=True)
        return 1
    if stopped_by:
        print(f"dualpath serve: stopped ({signal.Signals(stopped_by[0]).name})", flush=True)
    return 0
