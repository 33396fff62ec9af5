"""Bad input over real HTTP: the body size limit while the body streams in (declared or chunked,
memory bounded), JSON depth, integer ranges, invalid Unicode, NaN — each a 4xx in OpenAI's
error shape, never a 500, and the server still serves — and ``/metrics`` behind the API key."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.frontend.stub import StubBackend
from tests.serve.conftest import ServerProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

KEY = "sk-limits"
LIMIT = 4 << 20  # ApiOptions.max_body_bytes
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    kv = tmp_path_factory.mktemp("kv")
    proc = ServerProc(
        ["--kv-root", str(kv), "--hbm-tokens", "4096", "--api-key", f"lim={KEY}"], api_key=KEY
    )
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _headers(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **extra}


def _chat(extra: str = "") -> bytes:
    """A good chat request's JSON with ``extra`` (``, "key": value``) spliced in."""
    return (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + extra + "}"
    ).encode()


def _assert_error(status: int, body: bytes, want: int, param: str | None, text: str) -> None:
    assert status == want, body[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] is None
    assert err["param"] == param
    assert text in err["message"], err["message"]


def _assert_serves(server: ServerProc) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", content=_chat(), headers=_headers(), timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of the HTTP/1.1 response on ``sock`` (uvicorn sends Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(fields["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def _request_head(server: ServerProc, framing: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n{framing}\r\n"
        "\r\n"
    ).encode()


def test_declared_length_over_the_limit_is_413_before_any_body(server: ServerProc) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        sock.sendall(_request_head(server, "Content-Length: 1073741824"))  # then nothing
        status, body = _response(sock)  # a server waiting for the 1 GiB would time out here
    _assert_error(status, body, 413, None, "1073741824 bytes exceeds 4194304")
    _assert_serves(server)


def test_chunked_body_is_413_as_soon_as_it_passes_the_limit(server: ServerProc) -> None:
    chunk = b" " * (64 << 10)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        sock.sendall(_request_head(server, "Transfer-Encoding: chunked"))
        for _ in range(LIMIT // len(chunk) + 2):
            sock.sendall(framed)
        # the body has not ended (no last chunk): the answer must come anyway
        status, body = _response(sock)
    _assert_error(status, body, 413, None, "exceeds 4194304 bytes")
    _assert_serves(server)


def _status_kib(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(name)


def test_a_64_mib_chunked_body_is_413_in_bounded_memory(server: ServerProc) -> None:
    pid = server.proc.pid
    try:  # reset the peak (VmHWM) to the current RSS, so the peak during the request shows
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        peak = "VmHWM"
    except OSError:
        peak = "VmRSS"
    before = _status_kib(pid, "VmRSS")
    chunk = b" " * MIB

    def body() -> Iterator[bytes]:  # no length known: httpx sends it chunked
        for _ in range(64):
            yield chunk

    r = httpx.post(
        server.url + "/v1/chat/completions", content=body(), headers=_headers(), timeout=60
    )
    grown_mib = (_status_kib(pid, peak) - before) / 1024
    _assert_error(r.status_code, r.content, 413, None, "exceeds 4194304 bytes")
    assert grown_mib < 24, f"the server's {peak} grew by {grown_mib:.0f} MiB for a 64 MiB body"
    _assert_serves(server)


def test_a_chunked_body_under_the_limit_is_served(server: ServerProc) -> None:
    def body() -> Iterator[bytes]:
        yield from (_chat()[:10], _chat()[10:])

    r = httpx.post(
        server.url + "/v1/chat/completions", content=body(), headers=_headers(), timeout=60
    )
    assert r.status_code == 200, r.text


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_BODIES = {
    "nested 100,000 deep": (
        ("[" * 100_000 + "]" * 100_000).encode(),
        None,
        "deeper than 64 levels",
    ),
    "nested 3,000 deep in an unknown field": (
        _chat(f', "metadata": {_nested(3000)}'),
        None,
        "deeper than 64 levels",
    ),
    "nested 100 deep in an unknown field": (
        _chat(f', "metadata": {_nested(100)}'),
        None,
        "deeper than 64 levels",
    ),
    "seed 2**64": (_chat(f', "seed": {2**64}'), "seed", "less than or equal to"),
    "seed -1": (_chat(', "seed": -1'), "seed", "greater than or equal to 0"),
    "max_tokens 2**64": (
        f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": {2**64}}}'.encode(),
        "max_tokens",
        "less than or equal to 2147483647",
    ),
    "max_completion_tokens 2**64": (
        _chat(f', "max_completion_tokens": {2**64}'),
        "max_completion_tokens",
        "less than",
    ),
    "n 2**64": (_chat(f', "n": {2**64}'), "n", "less than or equal to 1"),
    "a 5,000-digit integer": (_chat(', "seed": ' + "7" * 5000), None, "5000 digits"),
    "NaN in an unknown field": (_chat(', "metadata": NaN'), None, "NaN is not a JSON number"),
    "a lone surrogate in a message": (
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
        "messages.0.content",
        "invalid Unicode",
    ),
    "a lone surrogate in a content part": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages.0.content.0.text",
        "invalid Unicode",
    ),
    "a lone surrogate in a stop string": (
        _chat(', "stop": ["ok", "\\ud800x"]'),
        "stop.1",
        "invalid Unicode",
    ),
    "bytes that are not UTF-8": (b'{"messages": "\xff"}', None, "not valid UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_chat_bodies_are_400(server: ServerProc, case: str) -> None:
    body, param, text = BAD_BODIES[case]
    r = httpx.post(
        server.url + "/v1/chat/completions", content=body, headers=_headers(), timeout=60
    )
    _assert_error(r.status_code, r.content, 400, param, text)
    _assert_serves(server)


def test_a_lone_surrogate_in_a_completion_prompt_is_400(server: ServerProc) -> None:
    body = b'{"prompt": "Read the file \\udc00", "max_tokens": 1}'
    r = httpx.post(server.url + "/v1/completions", content=body, headers=_headers(), timeout=60)
    _assert_error(r.status_code, r.content, 400, "prompt", "invalid Unicode")
    _assert_serves(server)


def test_metrics_need_the_api_key(server: ServerProc) -> None:
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.get(server.url + "/metrics", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert "dualpath:" not in r.text
    r = httpx.get(server.url + "/metrics", headers=server.auth_headers)
    assert r.status_code == 200 and "dualpath:request_errors_total" in r.text
    assert server.metric("dualpath:request_errors_total") >= 1  # 401s and 400s above
    _assert_serves(server)


@pytest.mark.parametrize("metrics_open", [False, True])
def test_metrics_open_serves_metrics_without_a_key(metrics_open: bool) -> None:
    from dualpath.frontend.api import ApiOptions, create_app

    opts = ApiOptions(api_keys={KEY: "lim"}, metrics_open=metrics_open)
    app = create_app(StubBackend(num_running=3), opts)  # type: ignore[arg-type]

    async def scrape() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/metrics"), await client.get("/v1/models")

    r, models = asyncio.run(scrape())
    assert r.status_code == (200 if metrics_open else 401)
    assert ("dualpath:num_requests_running 3.0" in r.text) is metrics_open
    assert models.status_code == 401  # the option opens /metrics only
