"""Large JSON schemas against a real server (``frontend/grammars.py``): a flood of 10,000-property
schemas is refused without delaying an unrelated request; a grammar over the compile budget
is a 400 naming its field, remembered by hash; a valid schema compiles once however many
requests carry it (and each engine compiles it once: ``runtime/token_choice.GrammarCache``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.serve.conftest import ServerProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "dualpath-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    kv = tmp_path_factory.mktemp("kv")
    proc = ServerProc(["--kv-root", str(kv), "--hbm-tokens", "4096", "--grammar-budget-s", "0.15"])
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _schema(n: int, tag: str = "p") -> dict[str, Any]:
    props = {f"{tag}{i}": {"type": "string", "maxLength": 4} for i in range(n)}
    return {"type": "object", "properties": props, "additionalProperties": False}


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_a_schema_flood_does_not_delay_an_unrelated_request(server: ServerProc) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)

    async def flood(k: int) -> Any:
        try:  # twelve different schemas (no cache to hide behind), 10,000 properties each
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "fill"}],
                max_tokens=8,
                response_format=_format(_schema(10_000, f"k{k}_")),
            )  # type: ignore[arg-type]
        except openai.BadRequestError as exc:
            return exc
        return None

    async def unrelated() -> float:
        await asyncio.sleep(0.2)  # the flood is in
        t0 = time.monotonic()
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, timeout=10
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        return time.monotonic() - t0

    async def run() -> tuple[list[Any], float]:
        *errors, took = await asyncio.gather(*(flood(k) for k in range(12)), unrelated())
        await client.close()
        return errors, took

    errors, took = asyncio.run(run())
    for exc in errors:
        assert isinstance(exc, Exception), "a 10,000-property schema was served"
        err = exc.body  # type: ignore[attr-defined]
        assert err["param"] == "response_format.json_schema", err
        assert "--max-grammar-bytes" in err["message"], err
    assert took < 10  # the client's own timeout; ~0.1 s here, 18-21 s before the limits


def test_a_grammar_over_the_compile_budget_is_400_and_remembered(server: ServerProc) -> None:
    import httpx

    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "response_format": _format(_schema(2500)),
    }
    url = server.url + "/v1/chat/completions"
    hits = server.metric("dualpath:grammar_cache_hits_total")
    first = httpx.post(url, json=body, timeout=60)
    assert first.status_code == 400, first.text
    err = first.json()["error"]
    assert err["param"] == "response_format.json_schema"
    assert "takes over 0.15 s to compile" in err["message"], err
    again = httpx.post(url, json=body, timeout=60)
    assert again.status_code == 400 and again.json() == first.json()
    assert server.metric("dualpath:grammar_cache_hits_total") == hits + 1


def test_a_schema_compiles_once_for_many_requests(server: ServerProc) -> None:
    import httpx

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 16,
        "response_format": _format(schema),
    }
    compiles = server.metric("dualpath:grammar_compiles_total")
    for _ in range(3):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"]) in (
            {"ok": True},
            {"ok": False},
        )
    assert server.metric("dualpath:grammar_compiles_total") == compiles + 1
