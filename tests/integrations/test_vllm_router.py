"""The router without vLLM: real side-car processes, buffers and store, the router over real
HTTP (uvicorn on loopback), fake vLLM instances behind it (``fake_vllm.FakeInstances``).

Keys and tenants as the default engine's; ``cached_tokens`` the store's hits in whole answers
and in the usage event of streams (and what ``/metrics`` counts); ``--default-max-tokens``
reaching the decode; every request bounded end to end (a 504 naming what it waited for, an
error event in a stream), and ended at once by a process going down; the slot gauges.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integrations.fake_vllm import FakeInstances, RouterServer, sidecars

from dualpath.integrations.vllm.router import RouterOptions
from dualpath.types import ReadSide

SYSTEM = "You are a coding agent. Read the file, run the tests, fix the bug. " * 2
KEYS = {"key-a": "acme", "key-b": "beta"}


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Any]:
    servers: list[RouterServer] = []
    with sidecars(tmp_path) as launched:
        fakes = FakeInstances(launched.deployment, str(tmp_path / "kv"))

        def start(**options: Any) -> tuple[RouterServer, FakeInstances]:
            s = RouterServer(launched, RouterOptions(**options), fakes)
            servers.append(s)
            return s, fakes

        yield start
        for s in servers:
            s.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _chat(url: str, key: str, user: str, **extra: Any) -> httpx.Response:
    body = {
        "model": "model",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=_auth(key), timeout=30)


def _stream(url: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=_auth(key), timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_keys_gate_every_route_but_health(serve: Any) -> None:
    s, _ = serve(api_keys=KEYS)
    routes = [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/v1/dualpath/decisions"),
    ]
    for method, path in routes:
        for headers in ({}, _auth("wrong"), {"Authorization": "Bearer key-c"}):
            r = httpx.request(method, s.url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers, r.text)
            # vLLM's error shape: its type word, the status as code
            assert r.json()["error"]["type"] == "Unauthorized"
            assert r.json()["error"]["code"] == 401
    assert httpx.get(s.url + "/health").status_code == 200  # a probe has no key
    assert httpx.get(s.url + "/v1/models", headers=_auth("key-b")).status_code == 200
    assert httpx.get(s.url + "/metrics", headers=_auth("key-a")).status_code == 200
    assert _chat(s.url, "key-a", "hello").status_code == 200
    opened, _ = serve(api_keys=KEYS, metrics_open=True)
    assert httpx.get(opened.url + "/metrics").status_code == 200
    assert httpx.get(opened.url + "/v1/models").status_code == 401


def test_cached_tokens_are_the_store_hits_per_tenant(serve: Any) -> None:
    """Cold: 0 (vLLM would say prompt − 1); the next turn: its hit blocks; another tenant with
    the same prompt: 0. Whole answers and the usage event of streams; ``/metrics`` the same."""
    s, fakes = serve(api_keys=KEYS)
    first = _chat(s.url, "key-a", "turn one")
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = _chat(s.url, "key-a", "turn one")
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = again.json()["usage"]["prompt_tokens"]
    assert cached == (prompt - 1) // 32 * 32 > 0  # every full block but the last token's
    other = _chat(s.url, "key-b", "turn one")
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    body = {
        "model": "model",
        "prompt": SYSTEM + "streamed",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cold = _stream(s.url, "key-a", body)
    assert [e["usage"]["prompt_tokens_details"] for e in cold if e.get("usage")] == [
        {"cached_tokens": 0}
    ]
    assert "".join(e["choices"][0]["text"] for e in cold if e["choices"]) == "tttt"
    warm = _stream(s.url, "key-a", body)
    (usage,) = [e["usage"] for e in warm if e.get("usage")]
    assert (
        usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 32 * 32
    )
    plain = _stream(s.url, "key-a", {**body, "stream_options": None})
    assert not [e for e in plain if e.get("usage")]  # no usage asked: none added
    warm_cached = usage["prompt_tokens_details"]["cached_tokens"]
    auth = _auth("key-a")  # the plain stream hit as the warm one did
    assert s.metric("dualpath:prefix_cache_hits_total", headers=auth) == cached + 2 * warm_cached
    assert s.metric("dualpath:requests_done_total", headers=auth) == 6
    # the tenant's namespace reached the decode (it persists under it)
    spaces = {d["kv_transfer_params"]["dualpath"]["store"]["namespace"] for d in fakes.seen}
    assert len(spaces) == 2


def test_default_max_tokens_reaches_the_decode(serve: Any) -> None:
    s, fakes = serve(default_max_tokens=7)
    assert _chat(s.url, "", "a").status_code == 200
    assert _chat(s.url, "", "b", max_tokens=3).status_code == 200
    assert _chat(s.url, "", "c", max_completion_tokens=5).status_code == 200
    assert [d.get("max_tokens") for d in fakes.seen] == [7, 3, None]
    assert fakes.seen[2]["max_completion_tokens"] == 5


def _free_slots(s: RouterServer) -> tuple[float, float]:
    return s.metric("dualpath:buffer_free_slots{"), s.metric("dualpath:buffer_slots{")


def test_every_request_ends_by_its_timeout(serve: Any) -> None:
    """The httpx timeout is per read; the request's is end to end: a decode that never
    answers (whole) is a 504 naming it, one that stalls mid-stream an error event; every slot
    is free afterwards."""
    s, fakes = serve(request_timeout_s=1.5)
    free, total = _free_slots(s)
    assert free == total > 0
    fakes.stall_s = 30.0
    t0 = time.monotonic()
    r = _chat(s.url, "", "slow")
    assert r.status_code == 504
    assert "request_timeout_s=1.5" in r.json()["error"]["message"]
    assert "the decode instance on node 1" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    fakes.stall_at = 1  # the first event comes, then nothing
    events = _stream(s.url, "", {"model": "m", "prompt": "x" * 70, "max_tokens": 4, "stream": True})
    assert events[-1]["error"]["type"] == "Gateway Timeout", events
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["t"]
    assert _free_slots(s) == (total, total)
    assert s.metric("dualpath:num_aborted_requests_total") == 2


def test_a_lost_process_ends_its_requests_at_once(serve: Any) -> None:
    """What the supervisor reports: requests that need the lost node end now (a 503 naming
    it, an error event mid-stream), ``/health`` is 503 and new requests a 503 until it is
    back; then served again."""
    import threading

    s, fakes = serve(request_timeout_s=60)
    fakes.stall_s, fakes.stall_at = 60.0, 1
    got: list[list[dict[str, Any]]] = []
    body = {"model": "m", "prompt": "y" * 80, "max_tokens": 4, "stream": True}
    t = threading.Thread(target=lambda: got.append(_stream(s.url, "", body)))
    t.start()
    deadline = time.monotonic() + 10
    while not fakes.seen and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # its first event is out, the second stalls

    async def lose() -> None:
        s.router.lose(
            "the vLLM decode instance on node 1",
            [1],
            "the vLLM decode instance on node 1 exited with code -9; restarting it",
        )

    t0 = time.monotonic()
    s.call(lose())
    t.join(timeout=10)
    assert time.monotonic() - t0 < 5
    (events,) = got
    assert (
        events[-1]["error"]["type"] == "ServiceUnavailableError"
        and "exited with code -9" in events[-1]["error"]["message"]
    )
    health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and "node 1" in json.dumps(health.json())
    r = _chat(s.url, "", "refused")
    assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]

    async def restore() -> None:
        s.router.restore("the vLLM decode instance on node 1")

    s.call(restore())
    fakes.stall_s = 0.0
    assert httpx.get(s.url + "/health").status_code == 200
    assert _chat(s.url, "", "served").status_code == 200
    free, total = _free_slots(s)
    assert free == total


def test_slot_gauges_and_waiters(tmp_path: Path) -> None:
    """The gauges follow what the requests hold. Each node buffer: 1 MiB / (2 layers × 32
    tokens × K and V × 1 head × 32 dims × 2 B) = 128 slots, all free when idle. A decode that
    stalls on a 4,000-token prompt holds ⌈4000 / 32⌉ = 125 of the DE node's slots, so a
    200-token request (7 slots) waits for slots; both end at the request timeout and every
    slot is free again. A turn that hits 64 tokens reads 2 blocks of 8,192 B through a 1 MB/s
    SNIC: 0.016384 s busy on the read side; the fake decode writes the store itself, so no
    SNIC's write side is busy."""
    import threading

    def gauge(name: str, label: str = "") -> float:
        return s.metric(f"dualpath:{name}", label)

    def wait_for(done: Any) -> None:
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            time.sleep(0.02)

    def complete(prompt: str) -> httpx.Response:
        body = {"model": "m", "prompt": prompt, "max_tokens": 4}
        return httpx.post(s.url + "/v1/completions", json=body, timeout=30)

    with sidecars(tmp_path, max_model_len=4096, snic_bytes_per_s=1e6) as launched:
        fakes = FakeInstances(launched.deployment, str(tmp_path / "kv"))
        s = RouterServer(launched, RouterOptions(request_timeout_s=6.0), fakes)
        try:
            for node in ("0", "1"):
                assert gauge("buffer_slots{", f'node="{node}"') == 128
                assert gauge("buffer_free_slots{", f'node="{node}"') == 128
            assert gauge("slot_waiters ") == 0
            assert gauge("snic_busy_seconds{") == 0

            fakes.stall_s = 60.0
            codes: list[int] = []
            held = threading.Thread(target=lambda: codes.append(complete("a" * 4000).status_code))
            held.start()
            wait_for(lambda: fakes.seen)
            assert gauge("buffer_free_slots{", 'node="1"') == 128 - 125
            assert gauge("buffer_free_slots{", 'node="0"') == 128
            waiting = threading.Thread(target=lambda: codes.append(complete("b" * 200).status_code))
            waiting.start()
            wait_for(lambda: gauge("slot_waiters ") == 1)
            assert gauge("slot_waiters ") == 1
            assert gauge("buffer_free_slots{", 'node="1"') == 128 - 125
            held.join(timeout=30)
            waiting.join(timeout=30)
            assert codes == [504, 504]
            # the slots go back off the event loop, maybe just after the 504s were sent
            wait_for(lambda: gauge("buffer_free_slots{") == 2 * 128)
            assert gauge("buffer_free_slots{") == 2 * 128
            assert gauge("slot_waiters ") == 0

            fakes.stall_s = 0.0
            assert complete("y" * 80).status_code == 200
            warm = complete("y" * 80)
            assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
            read = gauge("snic_busy_seconds{", 'direction="read"')
            assert read == pytest.approx(2 * 8192 / 1e6, rel=1e-9)
            assert gauge("snic_busy_seconds{", 'direction="write"') == 0
        finally:
            s.close()


def test_vllm_routes_and_fields_pass_through(serve: Any, capfd: pytest.CaptureFixture[str]) -> None:
    """vLLM's other routes reach an instance and come back as it answered; ``x-request-id``
    reaches both instances; ``n`` reaches only the decode; batched prompts come back as one
    answer (choices numbered across the batch, usage summed), whole and streamed."""
    s, fakes = serve(api_keys=KEYS)
    auth = _auth("key-a")
    r = httpx.post(s.url + "/tokenize", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200 and r.json() == {"tokens": [104, 105]}
    r = httpx.post(s.url + "/detokenize", json={"model": "m", "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}
    assert httpx.get(s.url + "/version").json() == {"version": "fake"}
    models = httpx.get(s.url + "/v1/models", headers=auth).json()["data"]
    assert models[0]["max_model_len"] == 512
    assert httpx.get(s.url + "/v1/models").status_code == 401  # /v1: the key, as vLLM's
    fakes.requests.clear()
    r = httpx.post(s.url + "/v1/responses", json={"model": "m", "input": "hi"}, headers=auth)
    assert r.status_code == 200 and r.json()["id"] == "resp_1"
    decode = s.router.dep.instance(1).url
    assert [u for u, _ in fakes.requests] == [decode + "/v1/responses"]  # its state lives there

    fakes.requests.clear()
    fakes.seen.clear()
    body = {"model": "m", "prompt": SYSTEM + "two", "max_tokens": 4, "n": 2}
    r = httpx.post(s.url + "/v1/completions", json=body, headers={**auth, "X-Request-Id": "r-7"})
    assert r.status_code == 200, r.text
    sent = [(u.rsplit("/", 2)[0], h.get("x-request-id")) for u, h in fakes.requests]
    assert (s.router.dep.instance(0).url, "r-7") in sent and (decode, "r-7") in sent
    assert fakes.seen[-1]["n"] == 2  # the decode samples the choices; the prefill ran once

    batch = {"model": "m", "prompt": [SYSTEM + "a", SYSTEM + "b", SYSTEM + "c"], "max_tokens": 4}
    r = httpx.post(s.url + "/v1/completions", json=batch, headers=auth)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["usage"]["completion_tokens"] == 3 * fakes.num_tokens
    assert got["usage"]["prompt_tokens"] == sum(len(SYSTEM) + 1 for _ in range(3))
    streamed = _stream(
        s.url, "key-a", {**batch, "stream": True, "stream_options": {"include_usage": True}}
    )
    texts = [e for e in streamed if e["choices"]]
    assert sorted(e["choices"][0]["index"] for e in texts) == [0] * 4 + [1] * 4 + [2] * 4
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 12
    assert len({e["id"] for e in streamed}) == 1

    r = httpx.post(s.url + "/v1/completions", json={"model": "m", "prompt": 7}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert r.json()["error"]["code"] == 400
    log = capfd.readouterr().err
    deadline = time.monotonic() + 5  # the access line goes out after the response (its thread)
    while '"POST /v1/completions" 400' not in log and time.monotonic() < deadline:
        time.sleep(0.05)
        log += capfd.readouterr().err
    assert '"POST /v1/completions" 200' in log and "x-request-id=r-7" in log
    assert '"POST /v1/completions" 400' in log
    free = s.metric("dualpath:buffer_free_slots{", headers=auth)
    assert free == s.metric("dualpath:buffer_slots{", headers=auth)  # every slot back


def test_the_read_side_route_forces_a_side_or_refuses_in_one_line(serve: Any) -> None:
    """``PUT /v1/dualpath/read_side``: policy, pe or de (the options' own list), else a 400
    naming the field; an accepted side is what the flow reads from next."""
    s, _ = serve()
    url = s.url + "/v1/dualpath/read_side"
    bad = httpx.put(url, json={"read_side": "both"})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["message"] == "read_side='both' is invalid: must be policy, pe or de"
    assert err["param"] == "read_side"
    for side in ("de", "pe", "policy"):
        r = httpx.put(url, json={"read_side": side})
        assert r.status_code == 200 and r.json() == {"read_side": side}
        assert s.flow.read_side == (None if side == "policy" else ReadSide(side))
