"""No request outlives ``request_timeout_s``: a request whose backend never
answers ends at its deadline with a 504 in OpenAI's error shape (or, in a stream that already
sent tokens, an error event), its backend request freed, the server still serving."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from tests.frontend.stub import HangingBackend

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 1.0
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _post(backend: HangingBackend, body: dict[str, object]) -> tuple[httpx.Response, float]:
    from dualpath.frontend.api import ApiOptions, create_app

    app = create_app(backend, ApiOptions(request_timeout_s=TIMEOUT_S))  # type: ignore[arg-type]

    async def call() -> tuple[httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            start = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body, timeout=30)
            return r, time.monotonic() - start

    return asyncio.run(call())


@pytest.mark.parametrize("num_tokens", [0, 3], ids=["no-token", "after-3-tokens"])
def test_a_hung_request_is_504_at_its_deadline(num_tokens: int) -> None:
    backend = HangingBackend(num_tokens)
    r, took_s = _post(backend, CHAT)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "timeout_error" and "request_timeout_s=1" in err["message"]
    assert TIMEOUT_S <= took_s < TIMEOUT_S + 2.0
    assert backend.freed == 1  # the backend's request was cancelled, not left running


@pytest.mark.parametrize("num_tokens", [0, 3], ids=["no-token", "after-3-tokens"])
def test_a_hung_stream_ends_with_an_error_event_at_its_deadline(num_tokens: int) -> None:
    backend = HangingBackend(num_tokens)
    r, took_s = _post(backend, {**CHAT, "stream": True})
    assert r.status_code == 200  # the stream had started: the error is its last event
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert texts == ["", *["x"] * num_tokens]  # the role chunk, then the tokens it had
    err = chunks[-1]["error"]
    assert err["type"] == "timeout_error" and "request_timeout_s=1" in err["message"]
    assert TIMEOUT_S <= took_s < TIMEOUT_S + 2.0
    assert backend.freed == 1


def test_bad_request_timeout_is_a_one_line_error() -> None:
    from dualpath.frontend.api import ApiOptions

    with pytest.raises(ValueError, match="request_timeout_s=0 is invalid"):
        ApiOptions(request_timeout_s=0)
