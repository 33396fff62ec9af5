"""Build a backend from the command line's options and run the HTTP server (uvicorn).

uvicorn handles SIGINT / SIGTERM: it stops accepting, lets in-flight requests finish for up
to ``graceful_s``, then cancels them; the app's lifespan then stops the backend (the engine
thread exits, queued requests end with ``abort``). The local backend holds no shared memory;
the runtime backend's scheduler process stops its engines and unlinks the node buffers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.config import Config
from dualpath.config.systems import SYSTEMS
from dualpath.serve.api import ApiOptions, create_app
from dualpath.serve.backend import Backend
from dualpath.serve.local import LocalBackend, LocalOptions

BACKENDS = ("local", "runtime")
RUNTIME_SYSTEMS = tuple(SYSTEMS)  # every system the runtime runs
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "local"
    model_dir: str | None = None  # an HF checkpoint; None: the preset's built-in tiny model
    device: str = "cpu"
    seed: int = 0
    api_keys: dict[str, str] = field(default_factory=dict)
    local: LocalOptions = field(default_factory=LocalOptions)
    system: str = "dualpath"  # --backend runtime: the policy (runtime's RuntimeOptions.system)
    kv_root: str = "./.dualpath/kv"  # --backend runtime: the persistent KV store
    hbm_tokens: int = 65536  # --backend runtime: each engine's paged HBM, tokens
    default_max_tokens: int = 256
    graceful_s: float = 5.0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"--backend {self.backend!r} is invalid: must be one of {', '.join(BACKENDS)}"
            )
        if self.system not in RUNTIME_SYSTEMS:
            raise ValueError(
                f"--system {self.system!r} is invalid: must be one of {', '.join(RUNTIME_SYSTEMS)}"
            )
        if self.backend == "runtime":
            if self.model_dir is not None:
                raise ValueError(
                    "--model-dir: the runtime backend's engines run the preset's built-in "
                    "model (use --backend local for an HF checkpoint)"
                )
            if self.device != "cpu":
                raise ValueError("--device: the runtime backend's engines run on cpu only")
            if len(set(self.api_keys.values())) > 1:
                raise ValueError(
                    "--api-key: the runtime backend serves one tenant per run (its KV "
                    "namespace); give keys of one tenant, or use --backend local"
                )
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"--device {self.device!r} is invalid: must be cpu or cuda[:N]")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is invalid: must be 0..65535")
        if self.default_max_tokens < 1:
            raise ValueError(f"default max_tokens={self.default_max_tokens} must be >= 1")

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def build_backend(config: Config, opts: ServeOptions) -> Backend:
    """The local backend over an HF checkpoint (``model_dir``) or the preset's tiny model;
    or the multi-process runtime (``--backend runtime``) on the preset's tiny model."""
    if opts.backend == "runtime":
        return _runtime_backend(config, opts)
    import torch

    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {opts.device}: CUDA is not available on this machine")
    if opts.model_dir is not None:
        from dualpath.runtime.hf_model import HFTransformer
        from dualpath.serve.tokenizer import HFTokenizer

        model = HFTransformer.from_dir(opts.model_dir, device=opts.device)
        tokenizer = HFTokenizer.from_dir(opts.model_dir, extra_eos_ids=model.spec.eos_token_ids)
        return LocalBackend(model, tokenizer, Path(opts.model_dir).name, opts.local)
    if opts.device != "cpu":
        raise ValueError("--device: the built-in tiny model runs on cpu only (use --model-dir)")
    from dualpath.runtime.model import TinyTransformer
    from dualpath.serve.local import TinyBatchModel
    from dualpath.serve.tokenizer import TinyTokenizer

    tiny = TinyTransformer(config.model, seed=opts.seed)
    return LocalBackend(
        TinyBatchModel(tiny),
        TinyTokenizer(config.model.vocab_size),
        f"dualpath-{config.model.name}",
        opts.local,
    )


def _runtime_backend(config: Config, opts: ServeOptions) -> Backend:
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.serve.runtime_backend import RuntimeBackend
    from dualpath.serve.tokenizer import TinyTokenizer

    tenants = sorted(set(opts.api_keys.values()))
    options = RuntimeOptions(
        system=opts.system,
        kv_root=opts.kv_root,
        hbm_tokens=opts.hbm_tokens,
        weight_seed=opts.seed,
        tenant=tenants[0] if tenants else "",
    )
    return RuntimeBackend(
        config,
        options,
        TinyTokenizer(config.model.vocab_size),
        f"dualpath-{config.model.name}",
        seed=opts.seed,
    )


def run_server(backend: Backend, opts: ServeOptions) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # shut down gracefully: exit 0 instead of re-raising SIGINT / SIGTERM
                stopped_by.extend(self._captured_signals)
                self._captured_signals.clear()

    stopped_by: list[int] = []

    app = create_app(
        backend, ApiOptions(api_keys=opts.api_keys, default_max_tokens=opts.default_max_tokens)
    )
    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level,
        timeout_graceful_shutdown=int(max(1, opts.graceful_s)),
        access_log=False,
    )
    _Server(config).run()
    if stopped_by:
        print(f"dualpath serve: stopped ({signal.Signals(stopped_by[0]).name})", flush=True)
    return 0
