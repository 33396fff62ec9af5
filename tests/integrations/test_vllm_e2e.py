"""DualPath inside vLLM, end to end on CPU: real vLLM instances (``.venv-vllm``, which
``make test`` installs), a tiny random HF Llama (head_dim 64), real HTTP on 127.0.0.1 through
the official ``openai`` client.

Greedy answers through ``dualpath serve --engine vllm`` (the prefill instance at PP=2 and the
decode at TP=2; in the preemption case the prefill at TP=2 and the decode at PP=2: blocks are
canonical, whatever wrote them) equal those of one plain vLLM instance on the same checkpoint, for a first turn and a second turn whose hit blocks come
from the store: once with every read forced to the PE side, once to the DE side (then
``/metrics`` counts bytes on ``storage_to_de_buffer``). A killed side-car (the node's storage
worker) and a killed prefill instance give clean errors, never a wrong answer, never a hang.
Across the network namespaces of ``dualpath cluster up``, the processes are placed by Ray
(``--runtime ray``), and what was killed comes back and serves.
With 64 usable KV blocks per instance, two long chats at once make vLLM preempt a decode that loaded
its prompt: the answers still equal plain vLLM's; streams closed early give every slot back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.integrations.deployments import Plain, route_answers  # noqa: E402
from tests.integrations.deployments import stop as _stop  # noqa: E402
from tests.integrations.deployments import wait_health as _wait_health  # noqa: E402
from tests.integrations.nodes import vllm_python  # noqa: E402
from tests.integrations.signals import (  # noqa: E402
    DASHBOARD,
    QUEUE,
    exported_names,
    metric_names,
)

from dualpath.net import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# scripts/gpu_check.py runs this file with "cuda" where a GPU (and vLLM's CUDA build) is there
DEVICE = os.environ.get("DUALPATH_VLLM_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# the parallel shapes on CPU (each rank a process on the host's cores); a GPU check machine has
# one GPU: there every instance is one rank


def _parallel(*flags: str) -> list[str]:
    return list(flags) if DEVICE == "cpu" else []


MODEL = "tiny"
FLAGS = ["--dtype", "float32", "--block-size", "32", "--max-model-len", "2048"]
SYSTEM = "You are a helpful coding agent. Read the file, run the tests, fix the bug. " * 3
PROMPT = (
    "The user asked for a summary of the repository layout and the failing test. "
    "def main(): print('hello world') return 0. Tool call: ls -la src/ && cat "
    "README.md | head -40. Observation: 3 passed, 1 failed in 0.52s. "
) * 2


def _kill_group(pgid: int, victims: set[str]) -> None:
    """SIGKILL process group ``pgid``, first noting the ``/dev/shm`` segments it maps (its
    engine's message queues and semaphores, its ranks' shared memory: a SIGKILLed vLLM
    cannot unlink its own) in ``victims``, for the test to remove: those, and nothing a
    process beside the suite made."""
    from dualpath.integrations.vllm.processes import group_segments

    victims |= group_segments(pgid)
    os.killpg(pgid, signal.SIGKILL)


def _remove_victims(victims: set[str]) -> None:
    """Remove the killed processes' segments that nothing maps any more."""
    from dualpath.integrations.vllm.processes import unlink_unmapped

    unlink_unmapped(victims)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / MODEL
    write_tiny_checkpoint(
        out, num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    return out


def _turns(client: Any, model: str) -> dict[str, Any]:
    """Two turns of one agent, as chat (whole and streamed) and as completions."""
    out: dict[str, Any] = {}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    kw: dict[str, Any] = {
        "model": model,
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    first = client.chat.completions.create(messages=msgs, **kw)
    out["chat1"] = first.choices[0].message.content
    msgs += [
        {"role": "assistant", "content": out["chat1"]},
        {"role": "user", "content": "Observation: the test passes now. Next?"},
    ]
    stream = client.chat.completions.create(messages=msgs, stream=True, **kw)
    out["chat2"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = client.completions.create(prompt=SYSTEM + PROMPT, **kw)
    out["text1"] = text.choices[0].text
    again = client.completions.create(prompt=SYSTEM + PROMPT + out["text1"] + " Next.", **kw)
    out["text2"] = again.choices[0].text
    return out


def _two_long_chats(
    client: Any, model: str, meanwhile: Callable[[], None] | None = None
) -> list[str]:
    """Two prompts answered at once, 1,400 tokens each, on 64 usable KV blocks of 32 tokens:
    a ~550-token one (18 blocks, 62 at its end) and a ~100-token one (4 blocks, 48 at its end).
    Whichever reaches the decode second still fits until the other has decoded ~1,300
    tokens; from then on both cannot grow to their end (62 + 48 > 64): vLLM preempts one
    of them whenever they overlap at all, whatever the order or lag between them.
    ``meanwhile`` runs once both are sent, while they are answered."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        prompt = f"Session {i}. " + ((SYSTEM + PROMPT) * 3 if i == 0 else PROMPT)
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=1400,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return str(r.choices[0].text)

    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(one, i) for i in range(2)]
        if meanwhile is not None:
            meanwhile()
        return [a.result() for a in answers]


class Reference:
    """The same turns through one plain vLLM instance (no connector, vLLM's defaults), started
    with the module and asked once, when a test first needs its answers: it starts while the
    first deployment does (a vLLM start here mostly waits)."""

    def __init__(self, plain: Plain) -> None:
        self.plain = plain
        self._got: dict[str, Any] | None = None

    def __getitem__(self, key: str) -> Any:
        if self._got is None:
            try:
                client = self.plain.ready(300).client
                self._got = {
                    "turns": _turns(client, MODEL),
                    "two": _two_long_chats(client, MODEL),
                    "routes": route_answers(self.plain.url, MODEL),
                }
            finally:
                self.plain.stop()
        return self._got[key]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    log = tmp_path_factory.mktemp("ref") / "vllm.log"
    cuda = ["--gpu-memory-utilization", "0.3"] if DEVICE == "cuda" else []
    ref = Reference(Plain(vllm_python(), checkpoint, MODEL, log, [*FLAGS, *cuda], ""))
    yield ref
    ref.plain.stop()


class Served:
    def __init__(
        self,
        checkpoint: Path,
        kv_root: Path,
        logs: Path,
        read_side: str,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = logs
        out = logs / "serve.log"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(checkpoint),
            "--port",
            str(self.port),
            "--kv-root",
            str(kv_root),
            "--dtype",
            "float32",
            "--vllm-max-model-len",
            "2048",
            "--read-side",
            read_side,
            "--vllm-log-dir",
            str(logs),
            "--device",
            DEVICE,
            "--set",
            "scheduler.record_decisions=true",
            *extra,
        ]
        with out.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        _wait_health(self.url, self.proc, out, 300)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="x", timeout=120, max_retries=0
        )

    def metric(self, name: str, label: str = "") -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and label in line and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def pids(self) -> dict[str, dict[str, int]]:
        data: dict[str, dict[str, int]] = json.loads((self.logs / "processes.json").read_text())
        return data

    def stop(self) -> int:
        return _stop(self.proc)


@pytest.fixture()
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    started: list[Served] = []
    kv_root = tmp_path_factory.mktemp("kv")  # one store for every server of the test

    def start(read_side: str, *extra: str) -> Served:
        logs = tmp_path_factory.mktemp(f"serve-{read_side}")
        s = Served(checkpoint, kv_root, logs, read_side, extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
        assert not [p for p in Path("/dev/shm").glob("dpv*") if str(s.proc.pid) in p.name]


def test_answers_equal_plain_vllm_on_both_read_paths(
    reference: dict[str, Any], served: Any
) -> None:
    victims: set[str] = set()
    # the prefill instance at PP=2 (each stage copies its own layers), the decode at TP=2
    # (each rank its KV head of the canonical blocks; a block goes to the store once both
    # ranks are done with it)
    pe = served(
        "pe",
        *_parallel(
            "--vllm-prefill-arg=--pipeline-parallel-size=2",
            "--vllm-decode-arg=--tensor-parallel-size=2",
        ),
    )
    if DEVICE == "cpu":
        prefill_log = "".join(p.read_text() for p in pe.logs.glob("vllm0-*.log"))
        assert "node 0, rank 0.0 (pp.tp), layers [0, 1] of 4" in prefill_log
        assert "node 0, rank 1.0 (pp.tp), layers [2, 3] of 4" in prefill_log
        decode_log = "".join(p.read_text() for p in pe.logs.glob("vllm1-*.log"))
        for rank in ("0.0", "0.1"):
            assert f"node 1, rank {rank} (pp.tp), layers [0, 1, 2, 3] of 4" in decode_log
    got = _turns(pe.client, MODEL)
    assert got == reference["turns"]
    assert pe.metric("dualpath:kv_bytes_total", 'path="storage_to_pe_buffer"') > 0
    assert pe.metric("dualpath:kv_bytes_total", 'path="pe_buffer_to_pe_hbm"') > 0
    assert pe.metric("dualpath:kv_bytes_total", 'path="storage_to_de_buffer"') == 0
    assert pe.metric("dualpath:prefix_cache_hits_total") > 0
    assert pe.metric("dualpath:requests_done_total") == 4
    # every route and field of vLLM's that clients use: the same status and answer
    routes = route_answers(pe.url, MODEL)
    assert routes == reference["routes"]
    assert routes["n=2"][0] == 200 and len(routes["n=2"][1]) == 2

    # the same deployment with every read forced to the DE side from now on (one start less
    # than a second deployment): the same store, so now even the first turns hit
    de = pe
    pe_read = de.metric("dualpath:kv_bytes_total", 'path="storage_to_pe_buffer"')
    assert httpx.put(de.url + "/v1/dualpath/read_side", json={"read_side": "de"}).status_code == 200
    assert _turns(de.client, MODEL) == reference["turns"]
    assert de.metric("dualpath:kv_bytes_total", 'path="storage_to_de_buffer"') > 0
    assert de.metric("dualpath:kv_bytes_total", 'path="de_buffer_to_pe_hbm"') > 0
    assert de.metric("dualpath:kv_bytes_total", 'path="storage_to_pe_buffer"') == pe_read
    decisions = httpx.get(de.url + "/v1/dualpath/decisions").json()["decisions"]
    sides = [d for d in decisions if d["kind"] == "side"][-4:]
    assert len(sides) == 4 and all(d["hit_tokens"] > 0 for d in sides)

    # a killed storage worker (the DE node's side-car): a clean error, never a wrong answer
    os.kill(de.pids()["sidecars"]["1"], signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as err:
        de.client.completions.create(
            model=MODEL, prompt=SYSTEM + PROMPT, max_tokens=4, temperature=0
        )
    assert err.value.status_code == 503
    # a killed prefill instance: the same
    _kill_group(de.pids()["instances"]["0"], victims)
    with pytest.raises(openai.APIStatusError) as err:
        de.client.completions.create(model=MODEL, prompt="a new prompt, no hits", max_tokens=4)
    assert err.value.status_code == 503
    assert de.stop() == 0
    assert not [p for p in Path("/dev/shm").glob(f"dpv{de.proc.pid}x*")], (
        "a buffer outlived its run"
    )
    _remove_victims(victims)  # the killed prefill instance's own segments


def test_preempted_and_aborted_requests_through_the_router(
    reference: dict[str, Any], served: Any
) -> None:
    """vLLM preempts a decode that loaded from the DE buffer: the answer still equals plain
    vLLM's (it recomputes, never reads stale pages); streams closed before and after their
    first byte give every slot back and the next requests are all answered."""
    # the prefill instance at TP=2 saves its KV heads, the decode (TP=1, PP=2) loads each
    # stage's layers of them, whole heads
    srv = served(
        "policy",
        "--vllm-arg=--num-gpu-blocks-override=65",
        *_parallel(
            "--vllm-prefill-arg=--tensor-parallel-size=2",
            "--vllm-decode-arg=--pipeline-parallel-size=2",
        ),
    )
    urls = json.loads((srv.logs / "processes.json").read_text())["urls"]

    def counter(url: str, name: str) -> float:
        total = 0.0
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def preemptions() -> float:
        return sum(counter(url, "vllm:num_preemptions_total") for url in urls.values())

    # vLLM preempts only while both decodes run. Here the four instance processes share two
    # cores: a decode that runs starves the other chat's prefill until it ends, and then
    # they never overlap. So the decode instance is stopped (SIGSTOP) until both prefills
    # have answered: both then reach the decode at once, and it must preempt one of them.
    decode = srv.pids()["instances"]["1"]
    prefilled = counter(urls["0"], "vllm:request_success_total")

    def both_prefilled() -> None:
        try:
            deadline = time.monotonic() + 120
            while counter(urls["0"], "vllm:request_success_total") < prefilled + 2:
                assert time.monotonic() < deadline, "the two prefills did not answer"
                time.sleep(0.1)
        finally:
            os.killpg(decode, signal.SIGCONT)

    os.killpg(decode, signal.SIGSTOP)
    assert _two_long_chats(srv.client, MODEL, both_prefilled) == reference["two"]
    assert preemptions() > 0, "the two chats did not overlap at the decode: " + "; ".join(
        line for line in (srv.logs / "serve.log").read_text().splitlines() if "POST" in line
    )

    de = 'node="1"'
    every = srv.metric("dualpath:buffer_slots", de)  # an idle deployment holds none
    body = {
        "model": MODEL,
        "prompt": SYSTEM + PROMPT,
        "max_tokens": 32,
        "stream": True,
        "temperature": 0,
    }
    for i in range(8):
        if i % 2:  # gone right after the first bytes
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                next(r.iter_raw())
        else:  # gone early: before any byte came back, as a rule (placement, prefill)
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.02 + 0.02 * i)
    deadline = time.monotonic() + 60
    while srv.metric("dualpath:buffer_free_slots", de) != every:
        assert time.monotonic() < deadline, "buffer slots leaked by aborted streams"
        time.sleep(0.2)
    for _ in range(4):
        r = srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert r.choices[0].text is not None
    assert srv.stop() == 0


def _nic_bytes(name: str) -> dict[tuple[str, str, str], int]:
    """The kernel's byte counters of every node's NICs: (node, nic, rx_bytes|tx_bytes)."""
    from dualpath.deploy import cluster

    out = {}
    for node in cluster.status(name)["nodes"]:
        for nic in ("cnic", "snic"):
            if isinstance(node.get(nic), dict):
                for d in ("rx_bytes", "tx_bytes"):
                    out[node["node"], nic, d] = int(node[nic][d])
    return out


@pytest.fixture()
def cluster_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A 1P1D cluster of network namespaces (``dualpath cluster up``), SNICs shaped to
    100 Mbit/s by the kernel; removed afterwards, and nothing of it left."""
    from dualpath.deploy import cluster

    reason = cluster.can_make_namespaces()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("DUALPATH_RUN_DIR", str(tmp_path / "run"))  # the served router's too
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    used = {int(w.split(".")[1]) for w in routes.split() if w.startswith("10.") and "." in w[3:]}
    name = f"e{os.getpid() % 100000}"
    spec = cluster.ClusterSpec.from_preset(
        "tiny-1p1d", name=name, snic_mbit=100, subnet=f"10.{min(set(range(200, 255)) - used)}"
    )
    cluster.up(spec)
    try:
        yield name
    finally:
        cluster.down(name)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dp-{name}-" not in spaces and f"dp{name}" not in links
    assert not list(Path("/dev/shm").glob(f"dp{name}-*"))


@contextlib.contextmanager
def _ray_on(cluster: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Ray over the cluster's nodes (``dualpath cluster ray``: the head in the root namespace,
    one raylet per node in its namespace offering ``dualpath_node<n>``); its GCS address.
    Stopped afterwards, before the cluster goes. (Started once no vLLM is starting beside it:
    its head gives up when its GCS is slow to come up on two busy cores.)"""
    from dualpath.deploy import ray_cluster
    from dualpath.deploy.cluster import ClusterState

    for k, v in ray_cluster.RAY_ENV.items():
        monkeypatch.setenv(k, v)  # the served router is a driver of this cluster
    rc = ray_cluster.start_ray(ClusterState.load(cluster), port=free_port())
    try:
        yield rc.address
    finally:
        ray_cluster.stop_ray(cluster)


def _ours_in(namespace: str) -> list[str]:
    """The side-cars, vLLM instances and store servers still running in ``namespace``."""
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True
    ).stdout.split()
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if any(m in cmd for m in ("vllm.sidecar", "vllm.entrypoints", "mooncake_store")):
                out.append(f"{pid} {cmd[:80]}")
    return out


def test_across_cluster_nodes_over_ray_answers_equal_plain_vllm_and_the_kernel_counts_each_path(
    reference: dict[str, Any], served: Any, cluster_up: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node in its own network namespace, its side-car and vLLM instance started there by
    Ray (``--runtime ray``: the host actor on the raylet offering ``dualpath_node<n>``), the
    store (Mooncake Store) on a storage host, KV between the nodes by Mooncake TE: greedy
    answers equal plain vLLM's on both read paths; the hit bytes cross the PE node's SNIC on
    the PE path, the DE node's SNIC and then its CNIC on the DE path (the kernel's counters);
    killed processes give clean errors, are restarted through Ray and serve again."""
    pytest.importorskip("ray")
    victims: set[str] = set()
    want = reference["turns"]  # (the plain instance asked, and stopped, first)
    try:
        with _ray_on(cluster_up, monkeypatch) as address:
            flags = f"--cluster {cluster_up} --store mooncake --runtime ray --ray-address {address}"
            srv = served("pe", *flags.split())
            try:
                _over_ray(srv, cluster_up, want, victims)
            finally:
                srv.stop()  # before Ray goes: it stops what Ray started
        for node in ("p0", "d0", "store"):
            left = _ours_in(f"dp-{cluster_up}-{node}")
            assert not left, f"processes left on node {node}: {left}"
    finally:
        _remove_victims(victims)  # the killed processes' own segments


def _first_turn(srv: Any) -> str:
    r = srv.client.completions.create(
        model=MODEL,
        prompt=SYSTEM + PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return str(r.choices[0].text)


def _over_ray(srv: Any, cluster_up: str, want: dict[str, Any], victims: set[str]) -> None:
    pids = srv.pids()
    for kind in ("sidecars", "instances"):  # each started in its node's namespace, by Ray
        for node, ns in (("0", "p0"), ("1", "d0")):
            inside = subprocess.run(
                ["ip", "netns", "pids", f"dp-{cluster_up}-{ns}"], capture_output=True, text=True
            ).stdout.split()
            assert str(pids[kind][node]) in inside, (kind, node, inside)
    start = _nic_bytes(cluster_up)
    assert _turns(srv.client, MODEL) == want
    pe_path = _nic_bytes(cluster_up)
    hits = srv.metric("dualpath:kv_bytes_total", 'path="storage_to_pe_buffer"')
    assert hits > 0 and srv.metric("dualpath:prefix_cache_hits_total") > 0

    def grew(before: dict[Any, int], after: dict[Any, int], node: str, nic: str, d: str) -> int:
        return after[node, nic, d] - before[node, nic, d]

    assert grew(start, pe_path, "p0", "snic", "rx_bytes") >= hits
    assert grew(start, pe_path, "d0", "snic", "rx_bytes") < hits / 4  # its writes' acks only
    assert grew(start, pe_path, "d0", "snic", "tx_bytes") > 0  # the decode persisted there
    # DualPath spreads the writes over both nodes' SNICs: the prefill node persisted prompts
    pe_written = srv.metric("dualpath:kv_bytes_total", 'path="pe_to_storage"')
    assert pe_written > 0 and grew(start, pe_path, "p0", "snic", "tx_bytes") > pe_written

    bad = httpx.put(srv.url + "/v1/dualpath/read_side", json={"read_side": "both"})
    assert bad.status_code == 400 and "read_side" in bad.text
    r = httpx.put(srv.url + "/v1/dualpath/read_side", json={"read_side": "de"})
    assert r.status_code == 200
    assert _turns(srv.client, MODEL) == want  # every turn hits now
    de_path = _nic_bytes(cluster_up)
    de_hits = srv.metric("dualpath:kv_bytes_total", 'path="storage_to_de_buffer"')
    assert de_hits > hits
    assert grew(pe_path, de_path, "d0", "snic", "rx_bytes") >= de_hits
    assert grew(pe_path, de_path, "d0", "cnic", "tx_bytes") >= de_hits  # DE buffer → PE node
    assert grew(pe_path, de_path, "p0", "snic", "rx_bytes") < de_hits / 4
    # each prefill's KV went to the decode node layer by layer, wholly: nothing pushed after
    layerwise = srv.metric("dualpath:cnic_pushed_bytes_total", 'mode="layerwise",node="0"')
    assert layerwise > 0
    assert srv.metric("dualpath:handover_slots_pushed_after_total") == 0
    assert srv.metric("dualpath:sidecar_refused_requests_total") == 0  # all carry the token
    # what an operator watches: every node's SNIC read queue back at zero, and every query of
    # the Grafana dashboard naming a metric this deployment exports
    exported = exported_names(srv.url)
    for name in QUEUE:
        assert f'{name}{{kind="pe",node="0"}} 0.0' in httpx.get(srv.url + "/metrics").text
    dash = json.loads(DASHBOARD.read_text())
    queried = {n for p in dash["panels"] for t in p["targets"] for n in metric_names(t["expr"])}
    assert queried and not queried - exported, sorted(queried - exported)

    # a killed side-car, a killed prefill instance: clean errors, never a hang
    os.kill(srv.pids()["sidecars"]["1"], signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as err:
        srv.client.completions.create(model=MODEL, prompt="a new prompt", max_tokens=4)
    assert err.value.status_code == 503
    old = srv.pids()["instances"]["0"]
    with contextlib.suppress(ProcessLookupError):  # (the side-car's restart may have begun it)
        _kill_group(old, victims)
    with pytest.raises(openai.APIStatusError) as err:
        srv.client.completions.create(model=MODEL, prompt="another prompt", max_tokens=4)
    assert err.value.status_code == 503
    # restarted through Ray, on the same nodes: serving again, the same answer
    deadline = time.monotonic() + 300
    while httpx.get(srv.url + "/health").status_code != 200:
        assert srv.proc.poll() is None and time.monotonic() < deadline, "not back"
        time.sleep(1)
    again = srv.pids()
    assert again["instances"]["0"] != old and again["sidecars"]["1"] != pids["sidecars"]["1"]
    inside = subprocess.run(
        ["ip", "netns", "pids", f"dp-{cluster_up}-p0"], capture_output=True, text=True
    ).stdout.split()
    assert str(again["instances"]["0"]) in inside
    hits_before = srv.metric("dualpath:prefix_cache_hits_total")
    assert _first_turn(srv) == want["text1"]
    assert srv.metric("dualpath:prefix_cache_hits_total") > hits_before  # from the store
    assert srv.metric("dualpath:restarts_total") >= 1  # (the instance restarts with it)
    # the store server killed: no hits any more, the same answers (recomputed), no error
    _kill_group(srv.pids()["services"]["0"], victims)
    assert _first_turn(srv) == want["text1"]
    assert srv.stop() == 0
