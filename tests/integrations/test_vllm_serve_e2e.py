"""``dualpath serve --engine vllm`` with the serve flags, end to end on CPU: real vLLM
instances (``.venv-vllm``), a tiny random Llama written by ``--init-tiny-checkpoint``, real
HTTP on 127.0.0.1 (``httpx``; ``dualpath loadgen``). One deployment for the whole module:

keys and tenants (401 on every route but ``/health``; two tenants never share blocks), tool
calls with ``--tool-parser hermes`` alone, ``cached_tokens`` 0 cold then the store's hits, the
hit ratio ``dualpath loadgen`` shows equal to ``/metrics``', and last the decode instance's
process group SIGKILLed during streams: clean error events, ``/health`` 503 and new requests
503 while it is down, served again once restarted, and after SIGTERM no process left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.integrations.nodes import vllm_python  # noqa: E402

from dualpath.integrations.vllm.processes import group_members  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KEYS = {"acme": "key-a", "beta": "key-b"}
SERVED = "agent-model"  # --served-model-name: the model id clients name
PROMPT = (
    "The user asked for a summary of the repository layout and the failing test. "
    "def main(): print('hello world') return 0. Tool call: ls -la src/ "
) * 2
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _segments() -> set[str]:
    return {p.name for pattern in ("psm_*", "sem.mp-*") for p in Path("/dev/shm").glob(pattern)}


class Served:
    def __init__(self, root: Path) -> None:
        from dualpath.net import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = root / "logs"
        self.out = root / "serve.log"
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(root / "tiny"),
            "--init-tiny-checkpoint",
            "--port",
            str(self.port),
            "--kv-root",
            str(root / "kv"),
            "--dtype",
            "float32",
            "--vllm-max-model-len",
            "2048",
            "--vllm-log-dir",
            str(self.logs),
            "--tool-parser",
            "hermes",
            "--request-timeout-s",
            "120",
            "--served-model-name",
            SERVED,
            *[a for t, k in KEYS.items() for a in ("--api-key", f"{t}={k}")],
        ]
        with self.out.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
        self.groups: set[int] = set()  # every process group the deployment ever had
        try:
            self.wait_health(300)
            self.groups |= self.current_groups()
        except BaseException:  # a start that failed leaves nothing running
            self.stop()
            raise

    def wait_health(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"serve exited with {self.proc.returncode}:\n{self.out.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout_s} s:\n{self.out.read_text()[-3000:]}")

    def current_groups(self) -> set[int]:
        pids = json.loads((self.logs / "processes.json").read_text())
        return {int(p) for kind in ("sidecars", "instances") for p in pids[kind].values()}

    def post(self, path: str, body: dict[str, Any], key: str = KEYS["acme"]) -> Any:
        return httpx.post(
            self.url + path, json=body, timeout=120, headers={"Authorization": f"Bearer {key}"}
        )

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": "Bearer key-a"}).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    vllm_python()
    before = _segments()
    s = Served(tmp_path_factory.mktemp("serve"))
    try:
        yield s
    finally:
        s.stop()
        from dualpath.integrations.vllm.processes import unlink_unmapped

        unlink_unmapped(_segments() - before)  # whatever a killed instance left (none, we hope)


def _chat(user: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def test_keys_gate_every_route_but_health(served: Served) -> None:
    routes = [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/v1/dualpath/decisions"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, served.url + path, json=_chat("hi"), headers=headers)
            assert r.status_code == 401, (path, r.text)
    assert httpx.get(served.url + "/health").status_code == 200
    assert (
        served.post(
            "/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2}, KEYS["beta"]
        ).status_code
        == 200
    )


def test_tool_calls_with_the_hermes_parser_alone(served: Served) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        r = served.post(
            "/v1/chat/completions",
            _chat("Weather in Paris?", tools=WEATHER, tool_choice=choice, max_tokens=64),
        )
        assert r.status_code == 200, (choice, r.text)  # (without the flags: vLLM's 400)
        if choice == "auto":
            continue
        # forced: a hermes call of get_weather (a random model's arguments may run to the end)
        answer = r.json()["choices"][0]
        calls = answer["message"].get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == ["get_weather"] or (
            answer["finish_reason"] == "length"
            and answer["message"]["content"].startswith('<tool_call>{"name": "get_weather"')
        ), answer


def test_cached_tokens_are_the_store_hits_and_loadgen_sees_them(
    served: Served, tmp_path: Path
) -> None:
    cold = served.post("/v1/chat/completions", _chat(PROMPT)).json()["usage"]
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0  # plain vLLM: 0 too
    warm = served.post("/v1/chat/completions", _chat(PROMPT)).json()["usage"]
    assert warm["prompt_tokens_details"]["cached_tokens"] == (warm["prompt_tokens"] - 1) // 32 * 32
    other = served.post("/v1/chat/completions", _chat(PROMPT), KEYS["beta"]).json()["usage"]
    assert other["prompt_tokens_details"]["cached_tokens"] == 0  # another tenant's namespace

    hits0 = served.metric("dualpath:prefix_cache_hits_total")
    queries0 = served.metric("dualpath:prefix_cache_queries_total")
    out = tmp_path / "loadgen.json"
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "loadgen",
            "--url",
            served.url,
            "--api-key",
            KEYS["acme"],
            "--agents",
            "2",
            "--turns",
            "3",
            "--concurrency",
            "2",
            "--max-gen",
            "8",
            "--json",
            str(out),
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    summary = json.loads(out.read_text())["summary"]
    hits = served.metric("dualpath:prefix_cache_hits_total") - hits0
    queries = served.metric("dualpath:prefix_cache_queries_total") - queries0
    assert summary["cached_tokens"] == hits > 0 and summary["prompt_tokens"] == queries
    assert summary["hit_ratio"] == pytest.approx(hits / queries)


def test_a_burst_of_chats_sharing_a_stored_prefix_all_hit(served: Served) -> None:
    """48 chats at once, each a new question after one long shared context whose blocks the
    store holds: every one answered, every one with hits (no side-car call refused, no KV
    write dropped), and ``/health`` answered meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    context = "Repository notes. " + PROMPT * 6  # ~1,000 tokens, shared by every chat
    first = served.post("/v1/chat/completions", _chat(context + " Question 0?"))
    assert first.status_code == 200, first.text
    failed0 = served.metric("dualpath:num_aborted_requests_total")

    def ask(i: int) -> tuple[int, int, int]:
        r = served.post("/v1/chat/completions", _chat(context + f" Question {i + 1}?"))
        usage = r.json().get("usage") or {} if r.status_code == 200 else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return r.status_code, int(usage.get("prompt_tokens", 0)), int(cached)

    health: list[float] = []
    with ThreadPoolExecutor(49) as pool:
        answers = pool.map(ask, range(48))
        for _ in range(5):
            t0 = time.monotonic()
            assert httpx.get(served.url + "/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t0)
        got = list(answers)
    assert [code for code, _, _ in got] == [200] * 48
    # the context's whole blocks: the tokens two of the prompts share (/tokenize, as vLLM's)
    a, b = (
        httpx.post(
            served.url + "/tokenize",
            json={"model": SERVED, "messages": _chat(context + q)["messages"]},
        ).json()["tokens"]
        for q in (" Question 0?", " Question 1?")
    )
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    shared = common // 32 * 32
    assert all(cached >= shared > 0 for _, _, cached in got), got
    assert served.metric("dualpath:num_aborted_requests_total") == failed0
    assert served.metric("dualpath:kv_persist_failed_blocks_total") == 0
    logs = "".join(p.read_text(errors="replace") for p in served.logs.glob("vllm*.log"))
    assert "not persisted" not in logs


def _stream(url: str, i: int, out: dict[int, list[str]]) -> None:
    """A long stream; its events (or, refused before its first byte, its status and body)."""
    body = {
        "model": SERVED,
        "prompt": f"stream {i} " * 20,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    events: list[str] = out.setdefault(i, [])
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEYS['acme']}"},
    ) as r:
        if r.status_code != 200:
            events.append(f"{r.status_code} {r.read().decode()}")
            return
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)


def test_a_killed_decode_is_replaced_and_sigterm_leaves_nothing(served: Served) -> None:
    pids = json.loads((served.logs / "processes.json").read_text())
    decode = int(pids["instances"]["1"])
    got: dict[int, list[str]] = {}
    threads = [threading.Thread(target=_stream, args=(served.url, i, got)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(len(v) for v in got.values()) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = time.monotonic()
    os.killpg(decode, signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - killed < 15
    assert len(got) == 4 and all(got.values())
    for events in got.values():  # tokens then one clean error event, or a 503 before any
        assert events[-1].startswith(('data: {"error"', "503 ")), events[-3:]
        assert "decode instance" in events[-1] and "[DONE]" not in "".join(events)

    deadline = time.monotonic() + 5
    while httpx.get(served.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health stayed 200 with its decode dead"
        time.sleep(0.05)
    t0 = time.monotonic()
    r = served.post("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and "decode instance on node 1" in r.text
    assert time.monotonic() - t0 < 2

    served.wait_health(240)  # restarted: as long as an instance takes to start
    r = served.post("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert group_members(decode) == []  # its EngineCore and worker went with it
    served.groups |= served.current_groups()
    assert served.metric("dualpath:restarts_total") == 1
    assert served.metric("dualpath:buffer_free_slots") == served.metric("dualpath:buffer_slots")

    assert served.stop() == 0
    assert [g for g in sorted(served.groups) if group_members(g)] == []
    assert not [p for p in Path("/dev/shm").glob(f"dpv{served.proc.pid}x*")]
