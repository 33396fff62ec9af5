"""A real `dualpath serve` under hostile clients (``frontend/guard.py``, ``frontend/logs.py``): idle
half-sent requests past the descriptor limit, Content-Length lies and bad framing, a flood of
malformed requests against the log — each answered in OpenAI's error shape or closed, and a
normal client (the official ``openai`` library) still served at once."""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.serve.conftest import ServerProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FD_LIMIT = 700  # the server's descriptor limit: the slowloris below opens more than this
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


class LimitedServer(ServerProc):
    """A server whose process (and children) may hold at most ``FD_LIMIT`` descriptors."""

    def __init__(self, args: list[str], log: Path) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
        try:  # Popen inherits the limit; ServerProc starts it in __init__
            super().__init__(args, log=log)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LimitedServer]:
    tmp = tmp_path_factory.mktemp("conns")
    proc = LimitedServer(
        [
            "--kv-root",
            str(tmp / "kv"),
            "--hbm-tokens",
            "4096",
            "--header-timeout-s",
            "30",
            "--body-timeout-s",
            "2",
            "--keepalive-requests",
            "2",
            "--keepalive-s",
            "30",
        ],
        log=tmp / "server.log",
    )
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _raw(server: ServerProc, data: bytes, shut: bool = False, wait_s: float = 20.0) -> bytes:
    """Send ``data`` on a new connection (then half-close it if ``shut``); all the server
    wrote until it closed (or ``<timeout>`` after ``wait_s``)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<timeout>"
        return out


def _error(reply: bytes, status: int, text: str) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), reply[:200]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert text in err["message"], err


def _chat(server: ServerProc, timeout_s: float = 10.0) -> str:
    import openai

    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=timeout_s
    )
    reply = client.chat.completions.create(
        model="dualpath-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    return reply.choices[0].finish_reason or ""


def test_slowloris_past_the_descriptor_limit_leaves_the_server_reachable(
    server: LimitedServer,
) -> None:
    # more half-sent requests than the server has descriptors: without the cap (oldest idle
    # closed to make room) accept() fails and the normal request below times out
    idle: list[socket.socket] = []
    try:
        for _ in range(FD_LIMIT + 300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(PARTIAL)
            idle.append(s)
        started = time.monotonic()
        assert _chat(server) in ("stop", "length")
        took = time.monotonic() - started
        assert took < 10, took  # the client's own timeout is 10 s; bounded, not a speed claim
        # the oldest half-sent requests were closed with a 408, the newest are still open
        idle[0].settimeout(5)
        first = idle[0].recv(4096)
        assert first.startswith(b"HTTP/1.1 408 "), first[:100]
    finally:
        for s in idle:
            s.close()
    assert server.metric("dualpath:connections_closed_total") >= 300


@pytest.mark.parametrize(
    ("case", "data", "status", "text"),
    [
        ("negative", b"Content-Length: -5\r\n\r\n", 400, "bad Content-Length"),
        ("huge", b"Content-Length: 100000000000000000000000\r\n\r\n", 400, "bad Content-Length"),
        ("twice", b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400, "conflicting"),
        ("bad chunk", b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhi\r\n0\r\n\r\n", 400, "chunk"),
    ],
)
def test_malformed_framing_is_400_in_openai_shape(
    server: LimitedServer, case: str, data: bytes, status: int, text: str
) -> None:
    _error(_raw(server, PARTIAL + data), status, text)


def test_a_body_shorter_than_its_content_length(server: LimitedServer) -> None:
    lie = PARTIAL + b"Content-Length: 1000\r\n\r\n0123456789"
    # the client stops sending: 408 after --body-timeout-s (2 s), not a hang
    _error(_raw(server, lie), 408, "no request body bytes for 2 s")
    # the client half-closes: 400 at once
    _error(_raw(server, lie, shut=True), 400, "ended before its Content-Length")
    assert _chat(server) in ("stop", "length")


def test_a_connection_serves_at_most_keepalive_requests(server: LimitedServer) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # keep-alive: HTTP/1.1's default
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        replies = b""
        for _ in range(2):
            s.sendall(request)
            time.sleep(0.3)
            replies += s.recv(65536)
        assert replies.count(b"HTTP/1.1 200 ") == 2
        s.settimeout(3)  # well before --keepalive-s 30
        assert s.recv(65536) == b""  # closed after --keepalive-requests 2


def test_a_flood_of_malformed_requests_logs_a_bounded_amount(server: LimitedServer) -> None:
    assert server.log is not None
    before = server.log.stat().st_size
    for _ in range(1000):
        _raw(server, PARTIAL + b"Content-Length: -5\r\n\r\n")
    grown = server.log.stat().st_size - before
    # uvicorn warns once per malformed request (~50 bytes): 50 kB without the rate limit
    assert grown < 2000, server.log.read_text()[-2000:]


def test_a_full_server_refuses_new_connections_not_accepted_requests(tmp_path: Path) -> None:
    """Every connection holds a request (headers in, body coming): a new one gets a 503 in
    OpenAI's shape, and the requests already accepted are still served."""
    proc = ServerProc(
        [
            "--kv-root",
            str(tmp_path / "kv"),
            "--hbm-tokens",
            "4096",
            "--max-connections",
            "3",
            "--body-timeout-s",
            "30",
        ]
    )
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
            s.sendall(PARTIAL + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
            held.append(s)
        time.sleep(0.5)  # the server has read their headers: each holds a request now
        _error(_raw(proc, PARTIAL + b"\r\n"), 503, "too many open connections")
        for s in held:  # the accepted requests complete and are answered
            s.sendall(body[10:])
        for s in held:
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    finally:
        for s in held:
            s.close()
        assert proc.stop() == 0
