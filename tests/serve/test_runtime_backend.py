"""Acceptance: `dualpath serve` on the built-in tiny model (scheduler, storage workers and PE/DE
engines as processes) on loopback, driven by the official `openai` client."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dualpath.types import KVPath

openai = pytest.importorskip("openai")

from tests.procs import descendants, shm_used_by  # noqa: E402
from tests.serve.conftest import ServerPool, ServerProc, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "dualpath-tiny"
# a prompt of several 64-token Full Blocks (tiny-1p1d's block size)
SYSTEM = "You are a careful coding agent. Think step by step and call one tool per turn. " * 4
TASK = "List the repository layout, then open the README file and summarise the build steps."


def _runtime_args(kv_root: Path, system: str = "dualpath") -> list[str]:
    return [
        "--system",
        system,
        "--preset",
        "tiny-1p1d",
        "--kv-root",
        str(kv_root),
        "--hbm-tokens",
        "4096",
    ]


@pytest.fixture(scope="module")
def rt_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool[ServerProc]]:
    # emulated GPU time: every test of the module also checks that it serves correctly
    pool = ServerPool(
        lambda: ServerProc(
            [*_runtime_args(tmp_path_factory.mktemp("kv")), "--gpu-time", "emulated"]
        )
    )
    try:
        yield pool
    finally:
        assert set(pool.close()) <= {0}


@pytest.fixture
def rt_server(rt_servers: ServerPool[ServerProc]) -> ServerProc:
    return rt_servers.live()


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=90)


def _chat(messages: list[dict[str, str]], tag: str = "") -> list[dict[str, str]]:
    return [{"role": "system", "content": tag + SYSTEM}, *messages]


def test_streaming_equals_non_streaming_greedy(rt_server: ServerProc) -> None:
    client = _client(rt_server)
    msgs = _chat([{"role": "user", "content": "stream test " + TASK}])
    kw: dict[str, Any] = dict(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    # warm the cache first: the runs compared below then prefill the same uncached tail (a
    # cold and a cached prefill compute in other shapes, and need not agree to the last bit)
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw)
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # tokens stream one decode step at a time: more than the first and the final chunk
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3


def test_second_turn_reports_cached_prompt_tokens(rt_server: ServerProc) -> None:
    client = _client(rt_server)
    msgs = _chat([{"role": "user", "content": TASK}], tag="session test. ")  # a new prefix
    first = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-Id": "agent-1"},
    )
    assert first.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.prompt_tokens >= 128
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Observation: 3 passed, 1 failed. Fix the failing test."},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-Id": "agent-1"},
    )
    assert second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    # every Full Block of the first prompt: durable before the first answer was returned
    assert cached >= first.usage.prompt_tokens // 64 * 64
    assert 0 < cached < second.usage.prompt_tokens
    assert rt_server.metric("dualpath:prefix_cache_hits_total") >= cached
    # the hit KV was read from the store through a SNIC (PE or DE side) and sent PE → DE
    # (the runtime's counters reach /metrics with its next stats snapshot: every 0.5 s)
    need = cached * 4 * 2 * 2 * 64 * 4  # layers × (K, V) × kv_heads × head_dim × 4 B

    def kv_bytes(*paths: KVPath) -> float:
        return sum(rt_server.metric(f'dualpath:kv_bytes_total{{path="{p}"}}') for p in paths)

    def counted() -> bool:
        read = kv_bytes(KVPath.STORAGE_TO_PE_BUFFER, KVPath.STORAGE_TO_DE_BUFFER)
        moved = min(kv_bytes(KVPath.PE_HBM_TO_DE_BUFFER), kv_bytes(KVPath.DE_TO_STORAGE))
        return read >= need and moved > 0

    assert wait_until(counted), rt_server.metric("dualpath:kv_bytes_total")


def test_sampling_is_seeded_and_stop_strings_cut_the_text(rt_server: ServerProc) -> None:
    client = _client(rt_server)

    def complete(**kw: object) -> openai.types.Completion:
        return client.completions.create(  # type: ignore[call-overload,no-any-return]
            model=MODEL,
            prompt="sampling test " + TASK,
            max_tokens=16,
            extra_body={"ignore_eos": True},
            **kw,
        )

    greedy = complete(temperature=0)
    a = complete(temperature=1.0, top_p=0.9, seed=7)
    b = complete(temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != greedy.choices[0].text  # 16 tokens from ~1024: never equal
    text = greedy.choices[0].text
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = complete(temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_bad_request_is_400_while_a_concurrent_good_one_succeeds(rt_server: ServerProc) -> None:
    client = _client(rt_server)
    result: dict[str, object] = {}

    def good() -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=_chat([{"role": "user", "content": "A long answer."}]),
            max_tokens=64,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        result["done"] = True

    t = threading.Thread(target=good)
    t.start()
    for bad in (
        dict(messages=[]),
        dict(messages=[{"role": "user", "content": "x"}], temperature=7),
        dict(messages=[{"role": "user", "content": "x"}], max_tokens=10**6),
        dict(messages=[{"role": "user", "content": "x"}], max_tokens=5000),  # > HBM pool
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, **bad)  # type: ignore[call-overload]
        assert err.value.status_code == 400
    t.join(timeout=180)
    assert result.get("done") is True


def test_client_disconnect_mid_stream_frees_the_request(rt_server: ServerProc) -> None:
    client = _client(rt_server)
    aborted_before = rt_server.metric("dualpath:num_aborted_requests_total")
    stream = client.completions.create(
        model=MODEL,
        prompt="disconnect test",
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for got, _ in enumerate(stream, start=1):
        if got == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = rt_server.metric("dualpath:num_requests_running")
        aborted = rt_server.metric("dualpath:num_aborted_requests_total")
        if aborted > aborted_before and running == 0:
            break
        time.sleep(0.2)
    assert rt_server.metric("dualpath:num_aborted_requests_total") == aborted_before + 1
    assert rt_server.metric("dualpath:num_requests_running") == 0  # gone from the runtime too
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_metrics_report_nic_utilisation_and_queues(rt_server: ServerProc) -> None:
    import httpx

    names = (
        'dualpath:nic_utilization{nic="snic_node0_read"}',
        'dualpath:nic_utilization{nic="cnic_engine0_tx"}',
        'dualpath:queue_length{queue="policy_waiting"}',
        f'dualpath:kv_bytes_total{{path="{KVPath.PE_HBM_TO_DE_BUFFER}"}}',
        "dualpath:num_preemptions_total",
        'dualpath:gpu_overrun_share{engine="pe',  # --gpu-time emulated: per engine
        'dualpath:gpu_overrun_share{engine="de',
        'dualpath:gpu_overrun_passes_total{engine="pe',
    )

    def missing() -> list[str]:
        text = httpx.get(rt_server.url + "/metrics").text
        return [name for name in names if name not in text]

    wait_until(lambda: not missing())  # (utilisation needs two stats snapshots)
    assert missing() == []
    assert rt_server.metric("dualpath:gpu_passes_total") >= 2  # passes and decode steps held


def test_sigterm_stops_every_process_and_unlinks_shared_memory(rt_server: ServerProc) -> None:
    """Stops the module's server (a test after it gets a fresh one: ``ServerPool``)."""
    _stop_with_a_request_in_flight(rt_server)


def _stop_with_a_request_in_flight(server: ServerProc) -> None:
    client = _client(server)
    stream = client.completions.create(
        model=MODEL, prompt="x", max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the request is running in the engines
    pid = server.proc.pid
    procs = descendants(pid)
    assert len(procs) >= 7  # scheduler + 2 storage workers + 4 engines (+ resource tracker)
    shm = shm_used_by(procs)
    assert shm  # the node buffers
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(openai.APIError):  # the stream ends without [DONE]
        for _ in stream:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in procs):
        time.sleep(0.1)
    assert [p for p in procs if Path(f"/proc/{p}").exists()] == []
    assert [f for f in shm if Path(f).exists()] == []
    kv_root = Path(server.args[server.args.index("--kv-root") + 1])
    assert any(kv_root.rglob("*"))  # the store stays: it is persistent


def test_sigterm_to_the_whole_process_group_is_a_clean_stop(tmp_path: Path) -> None:
    """`timeout`, a terminal or `kill -- -PGID` signal every process of the group at once:
    the runtime's processes leave the stop to the server (exit 0, nothing left behind)
    instead of dying under it (which made the server report a failed runtime, exit 1)."""
    import os
    import subprocess
    import sys

    import httpx
    from tests.serve.conftest import REPO, free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--port",
            str(port),
            *_runtime_args(tmp_path / "kv"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        procs = descendants(proc.pid)
        assert len(procs) >= 7
        shm = shm_used_by(procs)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "runtime stopped" not in out and "stopped (SIGTERM)" in out
        assert "leaked" not in out  # the resource tracker had nothing left to clean up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in procs):
            time.sleep(0.1)
        assert [p for p in procs if Path(f"/proc/{p}").exists()] == []
        assert [f for f in shm if Path(f).exists()] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
