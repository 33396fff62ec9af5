"""Acceptance: the real server on an HF checkpoint (through the DualPath runtime) on loopback,
driven by the official `openai` client."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tests.serve.conftest import ServerProc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _client(server: ServerProc, key: str = "sk-test") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_models_health_and_api_key(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    with pytest.raises(openai.AuthenticationError):
        _client(hf_server, key="wrong").models.list()


def test_non_streaming_chat(hf_server: ServerProc) -> None:
    r = _client(hf_server).chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Read the file and fix the bug."}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.choices[0].message.content  # the tokenizer decodes something


def test_streaming_chat_equals_non_streaming_at_temperature_zero(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    msgs = [{"role": "user", "content": "Run the tests and summarise the failure."}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0)
    # warm the cache first: the runs compared below then prefill the same uncached tail (a
    # cold and a cached prefill compute in other shapes, and need not agree to the last bit)
    client.chat.completions.create(**kw)  # type: ignore[call-overload]
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) >= 2


def test_second_turn_reports_cached_prompt_tokens(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    msgs = [
        {"role": "system", "content": "You are a helpful coding agent."},
        {"role": "user", "content": "List the repository layout, then open the README file."},
    ]
    first = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=8, extra_headers={"X-Session-Id": "agent-1"}
    )
    assert first.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Observation: 3 passed, 1 failed. Fix the failing test."},
    ]
    second = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=8, extra_headers={"X-Session-Id": "agent-1"}
    )
    assert second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # all full blocks of the first prompt
    assert 0 < cached < second.usage.prompt_tokens
    # without a session id (the `user` field instead), the resent conversation still hits
    third = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=4, user="agent-1"
    )
    assert third.usage is not None and third.usage.prompt_tokens_details.cached_tokens >= cached
    assert hf_server.metric("dualpath:prefix_cache_hits_total") > 0


def test_tenants_do_not_share_prefixes(hf_checkpoint: Path, tmp_path: Path) -> None:
    server = ServerProc(
        [
            "--model-dir",
            str(hf_checkpoint),
            "--api-key",
            "a=sk-a",
            "--api-key",
            "b=sk-b",
            "--block-tokens",
            "16",
            "--kv-root",
            str(tmp_path / "kv"),
        ]
    )
    try:
        msgs = [{"role": "user", "content": "The same long prompt from two tenants, twice."}]
        a, b = _client(server, "sk-a"), _client(server, "sk-b")
        a.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2)
        other = b.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2)
        same = a.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2)
        assert other.usage is not None and same.usage is not None
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        assert same.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        assert server.stop() == 0


def test_bad_request_is_400_while_a_concurrent_good_one_succeeds(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    result: dict[str, object] = {}

    def good() -> None:
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "A long answer please."}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        result["done"] = True

    t = threading.Thread(target=good)
    t.start()
    bad_inputs = [
        dict(messages=[]),
        dict(messages=[{"role": "wizard", "content": "x"}]),
        dict(messages=[{"role": "user", "content": "x"}], temperature=7),
        dict(messages=[{"role": "user", "content": "x"}], max_tokens=10**6),
        dict(messages=[{"role": "user", "content": "x" * 20000}]),
    ]
    for bad in bad_inputs:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-llama", **bad)  # type: ignore[call-overload]
        assert err.value.status_code == 400
        assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    t.join(timeout=120)
    assert result.get("done") is True


def test_client_disconnect_mid_stream_frees_the_request(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    aborted_before = hf_server.metric("dualpath:num_aborted_requests_total")
    stream = client.completions.create(
        model="tiny-llama",
        prompt="Tool call: ls -la",
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for got, _ in enumerate(stream, start=1):
        if got == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the runtime's stats reach /metrics every 0.5 s
        aborted = hf_server.metric("dualpath:num_aborted_requests_total") > aborted_before
        if aborted and hf_server.metric("dualpath:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert hf_server.metric("dualpath:num_aborted_requests_total") == aborted_before + 1
    assert hf_server.metric("dualpath:num_requests_running") == 0
    # the server keeps serving
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=3)
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_metrics_exposes_vllm_style_names(hf_server: ServerProc) -> None:
    import httpx

    assert httpx.get(hf_server.url + "/metrics").status_code == 401  # keys set: it needs one
    text = httpx.get(hf_server.url + "/metrics", headers=hf_server.auth_headers).text
    for name in (
        "dualpath:time_to_first_token_seconds_bucket",
        "dualpath:inter_token_latency_seconds_bucket",
        "dualpath:e2e_request_latency_seconds_count",
        "dualpath:num_requests_running",
        "dualpath:num_requests_waiting",
        "dualpath:prefix_cache_hit_ratio",
        'dualpath:kv_bytes_total{path="pe_hbm_to_de_buffer"}',
        "dualpath:request_success_total",
    ):
        assert name in text, name
    assert hf_server.metric("dualpath:e2e_request_latency_seconds_count") >= 1


def _shm_used_by(pid: int) -> set[str]:
    """/dev/shm files the process maps or holds open (the host's /dev/shm is shared with
    other jobs, so only this process's own entries are checked)."""
    used = set()
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    used |= {line.split()[-1] for line in maps if "/dev/shm/" in line}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                used.add(target)
    return used


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def test_stop_string_cuts_the_text_and_oversized_body_is_413(hf_server: ServerProc) -> None:
    import httpx

    client = _client(hf_server)
    kw = dict(model="tiny-llama", prompt="Read the file", temperature=0, max_tokens=24)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2
    cut = client.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    big = httpx.post(
        hf_server.url + "/v1/completions",
        content=b"{" + b" " * (5 << 20) + b"}",
        headers={"Authorization": "Bearer sk-test", "Content-Type": "application/json"},
    )
    assert big.status_code == 413
    assert big.json()["error"]["type"] == "invalid_request_error"


def test_non_streaming_client_that_gives_up_frees_the_request(hf_server: ServerProc) -> None:
    import httpx

    aborted_before = hf_server.metric("dualpath:num_aborted_requests_total")
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            hf_server.url + "/v1/completions",
            json=body,
            headers={"Authorization": "Bearer sk-test"},
            timeout=0.5,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the runtime's stats reach /metrics every 0.5 s
        aborted = hf_server.metric("dualpath:num_aborted_requests_total") > aborted_before
        if aborted and hf_server.metric("dualpath:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert hf_server.metric("dualpath:num_aborted_requests_total") == aborted_before + 1


def test_unsupported_options_are_400(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort: not supported"):
        client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            extra_body={"reasoning_effort": "high"},
        )
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2, echo=True)
