"""``dualpath serve --engine vllm``: the side-cars, the vLLM instances and the router, started
and stopped together.

One node per vLLM instance: prefill nodes first, then decode nodes. Each node gets a side-car
(``sidecar.py``: its buffer, SNIC, store reads and writes) and one vLLM OpenAI server started as
vLLM documents it (``python -m vllm.entrypoints.openai.api_server``, its own Python: vLLM may
live in a virtual environment of its own, ``--vllm-python``) with our connector loaded by
module path. On CPU the host's cores are split between the instances
(``VLLM_CPU_OMP_THREADS_BIND``) and each gets ``kv_cache_gib`` of KV cache
(``VLLM_CPU_KVCACHE_SPACE``). SIGTERM / SIGINT stop the router (uvicorn lets in-flight requests
finish for ``graceful_s``), then the instances, then the side-cars (whose queued writes land).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import IO, Any

from dualpath.integrations.vllm.node import NodeSpec, wait_ready
from dualpath.integrations.vllm.setup import Deployment, Instance, ModelShape

VLLM_PYTHON_ENV = "DUALPATH_VLLM_PYTHON"
DEFAULT_VLLM_VENV = ".venv-vllm"  # `make` installs vLLM here (its pins clash with ours)
CONNECTOR_MODULE = "dualpath.integrations.vllm.connector"


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python that runs vLLM: ``explicit``, ``$DUALPATH_VLLM_PYTHON``, ``.venv-vllm`` of
    this checkout or of the working directory, or this Python if it imports vLLM."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[4]]
    given = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if given:  # asked for: that one or an error, never a silent substitute
        if not Path(given).is_file():
            raise ValueError(f"--vllm-python {given}: no such file")
        return given
    for c in (str(r / DEFAULT_VLLM_VENV / "bin" / "python") for r in roots):
        if Path(c).is_file():
            return c
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ValueError(
        "vLLM is not installed: run `make vllm` (a venv of its own, .venv-vllm) or pass "
        "--vllm-python PATH"
    )


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

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "max_model_len", "kv_cache_gib", "buffer_mib"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.block_tokens < 32 or self.block_tokens % 32:
            raise ValueError(f"block_tokens={self.block_tokens} is invalid: vLLM needs a "
                             "multiple of 32")  # fmt: skip
        if self.read_side not in ("policy", "pe", "de"):
            raise ValueError(f"read_side={self.read_side!r} is invalid: must be policy, pe or de")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is invalid: must be cpu or cuda")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def core_masks(num_instances: int, num_cores: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per instance: the cores split evenly (``"0"``, ``"1-3"``),
    or ``"nobind"`` each when there are more instances than cores."""
    if num_instances > num_cores:
        return ["nobind"] * num_instances
    per = num_cores // num_instances
    return [f"{i * per}-{i * per + per - 1}" if per > 1 else str(i) for i in range(num_instances)]


@dataclass(slots=True)
class Launched:
    """The processes of one deployment and where their logs are."""

    deployment: Deployment
    run_dir: Path
    sidecars: list[subprocess.Popen[bytes]] = field(default_factory=list)
    instances: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)
    log_dir: Path | None = None

    def stop(self, grace_s: float = 10.0) -> None:
        """Instances first (SIGTERM, then SIGKILL after ``grace_s``), then the side-cars."""
        for group in (self.instances, self.sidecars):
            for p in group:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        for spec in self.deployment.nodes:  # a side-car killed hard left its buffer behind
            with contextlib.suppress(FileNotFoundError):
                shm = SharedMemory(spec.buffer_name)
                shm.close()
                shm.unlink()
        for f in self.logs:
            f.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def plan(opts: VllmOptions, weights_digest: str, run_dir: Path, engine: str) -> Deployment:
    """The nodes and instances ``opts`` asks for (ports chosen, nothing started)."""
    shape = ModelShape.from_checkpoint(opts.model_dir, opts.dtype)
    full_block = shape.num_layers * opts.block_tokens * shape.row_bytes
    num_slots = max(1, opts.buffer_mib * 2**20 // full_block)
    tag = f"dpv{os.getpid()}x{int(time.time() * 1000) % 100000}"
    nodes, instances = [], []
    store_ns = ""
    for node in range(opts.num_prefill + opts.num_decode):
        kind = "pe" if node < opts.num_prefill else "de"
        port = opts.first_port + node if opts.first_port else free_port()
        nodes.append(NodeSpec(node, kind, f"{tag}n{node}", num_slots,
                              str(run_dir / f"node{node}.lock"), str(run_dir / f"node{node}.sock"),
                              opts.kv_root, shape.num_layers, opts.block_tokens, shape.row_bytes,
                              store_ns, opts.snic_bytes_per_s))  # fmt: skip
        instances.append(Instance(node, kind, f"http://127.0.0.1:{port}"))
    kv_tokens = opts.kv_cache_gib * 2**30 // (shape.num_layers * shape.row_bytes)
    dep = Deployment(tuple(nodes), tuple(instances), Path(opts.model_dir).name or "model",
                     opts.block_tokens, weights_digest, shape, engine, kv_tokens)  # fmt: skip
    ns = dep.namespace("")  # the tenant-free namespace in every block header
    return Deployment(tuple(_with_ns(n, ns) for n in nodes), dep.instances, dep.model,
                      dep.block_tokens, weights_digest, shape, engine, kv_tokens)  # fmt: skip


def _with_ns(spec: NodeSpec, ns: str) -> NodeSpec:
    d = json.loads(spec.to_json())
    d["store_namespace"] = ns
    return NodeSpec(**d)


def instance_command(opts: VllmOptions, dep: Deployment, inst: Instance,
                     python: str) -> list[str]:  # fmt: skip
    """The vLLM server command of one instance, our connector loaded by module path."""
    kv_config = {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"node": inst.node,
                                      "nodes": [json.loads(n.to_json()) for n in dep.nodes]},
    }  # fmt: skip
    port = inst.url.rsplit(":", 1)[1]
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model_dir,
        "--served-model-name", dep.model, "--host", "127.0.0.1", "--port", port,
        "--dtype", opts.dtype, "--block-size", str(opts.block_tokens),
        "--max-model-len", str(opts.max_model_len), "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_config),
        # the instances share the GPU(s): each takes its part of the memory
        *(["--gpu-memory-utilization", f"{0.8 / len(dep.instances):.2f}"]
          if opts.device == "cuda" else []),
        *opts.extra_vllm_args,
    ]  # fmt: skip


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


def launch(opts: VllmOptions, weights_digest: str, engine: str) -> Launched:
    """Start the side-cars and the instances; return once every instance serves ``/health``
    (RuntimeError naming the instance and its log's last lines if one fails)."""
    python = find_vllm_python(opts.vllm_python)
    run_dir = Path(tempfile.mkdtemp(prefix="dualpath-vllm-"))
    log_dir = Path(opts.log_dir) if opts.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    dep = plan(opts, weights_digest, run_dir, engine)
    out = Launched(dep, run_dir, log_dir=log_dir)
    try:
        for spec in dep.nodes:
            log = open(log_dir / f"sidecar{spec.node}.log", "wb")  # noqa: SIM115 (kept open)
            out.logs.append(log)
            out.sidecars.append(subprocess.Popen(
                [sys.executable, "-m", "dualpath.integrations.vllm.sidecar", spec.to_json()],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        for spec in dep.nodes:
            wait_ready(spec.socket_path)
        masks = core_masks(len(dep.instances), os.cpu_count() or 1)
        for inst, mask in zip(dep.instances, masks, strict=True):
            log = open(log_dir / f"vllm{inst.node}-{inst.kind}.log", "wb")  # noqa: SIM115
            out.logs.append(log)
            out.instances.append(subprocess.Popen(
                instance_command(opts, dep, inst, python), env=vllm_env(opts, mask),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        pids = {"sidecars": {s.node: p.pid for s, p in zip(dep.nodes, out.sidecars, strict=True)},
                "instances": {i.node: p.pid for i, p in zip(dep.instances, out.instances,
                                                             strict=True)}}  # fmt: skip
        (log_dir / "processes.json").write_text(json.dumps(pids))  # for operators and tests
        _wait_healthy(out, opts.startup_timeout_s)
    except BaseException:
        out.stop(grace_s=2.0)
        raise
    return out


def _wait_healthy(out: Launched, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(zip(out.deployment.instances, out.instances, strict=True))
    while pending:
        inst, proc = pending[0]
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM instance on node {inst.node} ({inst.kind}) exited with "
                               f"{proc.returncode}:\n{_tail(out, inst)}")  # fmt: skip
        try:
            if httpx.get(inst.url + "/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM instance on node {inst.node} not ready after {timeout_s} s:"
                               f"\n{_tail(out, inst)}")  # fmt: skip
        time.sleep(0.5)


def _tail(out: Launched, inst: Instance, lines: int = 15) -> str:
    assert out.log_dir is not None
    path = out.log_dir / f"vllm{inst.node}-{inst.kind}.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def engine_name(python: str) -> str:
    """``vllm-<distribution>-<version>`` of the vLLM that ``python`` runs (the byte layout)."""
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try: print(d + '-' + m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")  # fmt: skip
    try:
        got = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"cannot run {python}: {err}") from None
    name = got.stdout.strip()
    if got.returncode or not name:
        raise ValueError(f"{python} has no vLLM installed ({got.stderr.strip()[-200:]})")
    return name


def serve_vllm(opts: VllmOptions, config: Any, system: str, log_level: str = "warning",
               limits: Any = None) -> int:  # fmt: skip
    """Run the whole deployment until SIGTERM / SIGINT; the exit code."""
    from dualpath.config import config_for
    from dualpath.config.systems import system_spec
    from dualpath.integrations.vllm.flow import TurnFlow
    from dualpath.integrations.vllm.router import Router, create_app
    from dualpath.policy import make_policy
    from dualpath.runtime.weights import checkpoint_digest
    from dualpath.serve.server import http_server
    from dualpath.types import ReadSide

    if config.scheduler.split_reads:  # refused before anything starts, never a 500 a request
        raise ValueError("scheduler.split_reads=true is not supported by --engine vllm (each "
                         "request reads its hit KV through one node): set it to false")  # fmt: skip
    python = find_vllm_python(opts.vllm_python)
    engine = engine_name(python)
    opts = VllmOptions(**{**_fields(opts), "vllm_python": python})
    policy = make_policy(config_for(config, system_spec(system)))
    t0 = time.monotonic()
    launched = launch(opts, checkpoint_digest(opts.model_dir), engine)
    force = None if opts.read_side == "policy" else ReadSide(opts.read_side)
    flow = TurnFlow(launched.deployment, policy, opts.kv_root, force_side=force)
    try:
        print(
            f"dualpath: {engine}: {opts.num_prefill}P{opts.num_decode}D ready in "
            f"{time.monotonic() - t0:.1f} s; router on http://{opts.host}:{opts.port} "
            f"(system {system}; logs in {launched.log_dir})",
            file=sys.stderr,
            flush=True,
        )
        http = http_server(create_app(Router(flow)), opts.host, opts.port, log_level,
                           opts.graceful_s, limits)  # fmt: skip
        http.run()
        if http.stopped_by:
            print(f"dualpath serve: stopped ({signal.Signals(http.stopped_by[0]).name})",
                  flush=True)  # fmt: skip
    finally:
        flow.close()
        launched.stop()
    return 0


def _fields(opts: VllmOptions) -> dict[str, Any]:
    return {name: getattr(opts, name) for name in VllmOptions.__dataclass_fields__}
