"""Acceptance: `dualpath serve --runtime ray` on a local two-raylet Ray cluster (loopback only),
an HF checkpoint, driven by the official `openai` client.

Each raylet offers its node's marker resource, so the PE's actors land on one Ray node and the
DE's on the other; KV between them crosses "nodes" over the TCP transport.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from tests.procs import descendants, two_raylets  # noqa: E402
from tests.serve.conftest import REPO, ServerPool, ServerProc, free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "tiny-llama"
ACTOR_CLASSES = ("EngineActor", "StorageActor", "Mailbox")
# Ray rewrites a loopback address to the host's own IP; this keeps every Ray process of the
# server (its driver: the scheduler process) on loopback, as the cluster's raylets are
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class RayCluster(NamedTuple):
    address: str  # the head's GCS, HOST:PORT
    temp: str  # the private temp dir (Ray's default one for every process of the test)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    """The two raylets (``tests.procs.two_raylets``); this process asks their GCS where the
    server's actors live."""
    with two_raylets() as (c, temp):
        yield RayCluster(c.address, temp)


class RayServer(ServerProc):
    """``dualpath serve`` whose output goes to a file (Ray forwards its actors' logs to the
    driver: a pipe nobody reads could fill) and whose Ray processes stay on loopback."""

    def __init__(self, args: list[str], log: Path, extra_env: dict[str, str]) -> None:
        self.port = free_port()
        self.args = args
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra_env}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dualpath.cli.main",
                    "serve",
                    "--port",
                    str(self.port),
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        try:
            self.wait_ready(timeout_s=120.0)
        except RuntimeError as err:
            raise RuntimeError(f"{err}\n{log.read_text()[-4000:]}") from None


@pytest.fixture(scope="module")
def ray_servers(
    cluster: RayCluster, hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool[RayServer]]:
    def start() -> RayServer:
        kv = tmp_path_factory.mktemp("kv")
        # one engine per node: a PE actor on node 0, a DE actor on node 1 (each imports torch)
        args = [
            "--runtime",
            "ray",
            "--ray-address",
            cluster.address,
            "--model-dir",
            str(hf_checkpoint),
            "--block-tokens",
            "16",
            "--kv-root",
            str(kv),
            "--set",
            "hardware.gpus_per_node=1",
            "--hbm-tokens",
            "4096",
            "--host",
            "127.0.0.1",
        ]
        env = {**LOOPBACK_ENV, "RAY_TMPDIR": cluster.temp}
        return RayServer(args, tmp_path_factory.mktemp("log") / "serve.log", env)

    pool = ServerPool(start)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def ray_server(ray_servers: ServerPool[RayServer]) -> RayServer:
    return ray_servers.live()


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=90)


def _alive_actors() -> list[dict[str, Any]]:
    """The GCS's live actors of the runtime's classes (every job's: the server's is another)."""
    table = ray._private.state.actors(actor_state_name="ALIVE").values()
    return [a for a in table if a["ActorClassName"] in ACTOR_CLASSES]


def _marker_of_node() -> dict[str, str]:
    """Ray node id → the ``dualpath_node<n>`` resource it offers."""
    out = {}
    for node in ray.nodes():
        marks = [r for r in node["Resources"] if r.startswith("dualpath_node")]
        if node["Alive"] and marks:
            out[node["NodeID"]] = marks[0]
    return out


def test_bad_ray_address_is_one_line_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dualpath.cli.main import main

    dead = f"127.0.0.1:{free_port()}"  # nobody listens there
    assert main(["serve", "--runtime", "ray", "--ray-address", dead]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"--ray-address '{dead}' is unreachable" in err


def test_actors_run_on_the_node_that_offers_their_emulated_node(ray_server: RayServer) -> None:
    marker = _marker_of_node()
    assert sorted(marker.values()) == ["dualpath_node0", "dualpath_node1"]
    actors = _alive_actors()
    by_class: dict[str, list[str]] = {}
    for a in actors:
        by_class.setdefault(a["ActorClassName"], []).append(marker[a["Address"]["NodeID"]])
    # engine 0 is the PE (node 0), engine 1 the DE (node 1): two engines on two Ray nodes
    assert sorted(by_class["EngineActor"]) == ["dualpath_node0", "dualpath_node1"]
    assert sorted(by_class["StorageActor"]) == ["dualpath_node0", "dualpath_node1"]
    assert len(by_class["Mailbox"]) == 1
    # loopback only: the HTTP server, the scheduler process and every actor (KV transport,
    # Ray's own worker ports)
    procs = [ray_server.proc.pid, *descendants(ray_server.proc.pid)]
    bound = _listening(procs + [a["Pid"] for a in actors])
    assert f"127.0.0.1:{ray_server.port}" in bound
    assert len(bound) > len(actors)  # one port per actor at least: the sockets were found
    assert [a for a in bound if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback] == []


def test_streaming_equals_non_streaming_greedy(ray_server: RayServer) -> None:
    client = _client(ray_server)
    msgs = [{"role": "user", "content": "Run the tests and summarise the failure."}]
    kw: dict[str, Any] = dict(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    # warm the cache first: the runs compared below then prefill the same uncached tail (a
    # cold and a cached prefill compute in other shapes, and need not agree to the last bit)
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw)
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2


def test_second_turn_hits_kv_that_crossed_nodes(ray_server: RayServer) -> None:
    client = _client(ray_server)
    msgs = [
        {"role": "system", "content": "You are a careful coding agent on a Ray cluster."},
        {"role": "user", "content": "List the repository layout, then open the README file."},
    ]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Observation: 3 passed, 1 failed. Fix the failing test."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16  # every Full Block of turn 1
    assert 0 < cached < second.usage.prompt_tokens
    deadline = time.monotonic() + 10  # the runtime's counters reach /metrics every 0.5 s
    read = 0.0
    while time.monotonic() < deadline and not read:
        read = ray_server.metric(
            'dualpath:kv_bytes_total{path="storage_to_pe_buffer"}'
        ) + ray_server.metric('dualpath:kv_bytes_total{path="storage_to_de_buffer"}')
        time.sleep(0.1)
    assert read > 0  # the hit KV was read from the store through a SNIC
    # PE (node 0) → DE buffer (node 1): over TCP between the two Ray nodes
    assert ray_server.metric('dualpath:kv_bytes_total{path="pe_hbm_to_de_buffer"}') > 0


def test_sigterm_exits_0_and_leaves_no_process_or_actor(ray_server: RayServer) -> None:
    """Stops the module's server (a test after it gets a fresh one: ``ServerPool``)."""
    procs = descendants(ray_server.proc.pid)  # the scheduler process (Ray's driver) …
    actor_pids = [a["Pid"] for a in _alive_actors()]  # … and the actors, the raylets' children
    assert procs and len(actor_pids) == 5  # 2 engines, 2 storage actors, the mailbox
    ray_server.proc.send_signal(signal.SIGTERM)
    assert ray_server.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (_alive_actors() or _running(procs + actor_pids)):
        time.sleep(0.2)
    assert _alive_actors() == []
    assert _running(procs + actor_pids) == []
    assert "Traceback" not in ray_server.log.read_text()


def _listening(pids: list[int]) -> set[str]:
    """``ip:port`` of every TCP socket in LISTEN state that one of ``pids`` holds (from
    ``/proc``; an IPv4-mapped IPv6 address as its IPv4)."""
    inodes: set[str] = set()
    for p in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                ip = ipaddress.ip_address(
                    b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                )
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                out.add(f"{ip}:{int(port, 16)}")
    return out


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie has exited: it only awaits its reaper)."""
    out = []
    for p in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(p)
    return out
