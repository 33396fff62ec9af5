"""Reasoning parsers (``frontend/reasoning.py``): ``<think>`` split off whole or streamed, and, on
the HTTP app with a scripted reply, into ``reasoning_content`` (chat, streamed too) and a
reasoning item (Responses), never into the content or a tool call's arguments; and, on the same
scripted app, ``parallel_tool_calls: false``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dualpath.frontend.reasoning import REASONING_PARSERS, prompt_opens_reasoning, reasoning_grammar
from dualpath.frontend.tool_families import Hermes
from dualpath.frontend.tools import Tool, grammar_error

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from tests.serve.test_responses import ScriptBackend  # noqa: E402

CALL = '<tool_call>\n{"name": "roll", "arguments": {"sides": 6}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants a die <roll>.\n</think>\n\n"


def _stream(name: str, text: str, step: int, opened: bool = False) -> tuple[str, str]:
    p = REASONING_PARSERS[name](opened)
    out = [p.feed(text[i : i + step]) for i in range(0, len(text), step)] + [p.feed("", True)]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_qwen3_splits_a_think_block_streamed_or_whole(step: int) -> None:
    assert _stream("qwen3", THOUGHT + "Six.", step) == ("\nThe user wants a die <roll>.\n", "Six.")
    assert _stream("qwen3", "No thinking <think> here", step) == ("", "No thinking <think> here")
    assert _stream("qwen3", "so on</think>Six.", step, opened=True) == ("so on", "Six.")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_deepseek_r1_starts_inside_reasoning(step: int) -> None:
    assert _stream("deepseek_r1", "hmm</think>\n\nSix.", step) == ("hmm", "Six.")
    assert _stream("deepseek_r1", "<think>hmm</think>Six.", step) == ("hmm", "Six.")
    assert _stream("deepseek_r1", "cut by max_tokens", step) == ("cut by max_tokens", "")


def test_a_prompt_that_opens_think_is_seen() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_forcing_grammar_lets_the_model_think_first() -> None:
    g = Hermes.call_grammar([Tool("f")])
    for opened in (True, False):
        assert grammar_error(reasoning_grammar(g, opened)) == ""
    assert reasoning_grammar(g, False).startswith('start: ("<think>"')


async def _chat(pieces: list[str], **kw: Any) -> tuple[Any, list[Any]]:
    import httpx2

    from dualpath.frontend.api import create_app
    from dualpath.frontend.service import ApiOptions

    app = create_app(ScriptBackend(pieces), ApiOptions(reasoning_parser="qwen3"))  # type: ignore[arg-type]
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
        )
        if "input" in kw:
            whole = await client.responses.create(**kw)
            events = [e async for e in await client.responses.create(**kw, stream=True)]
        else:
            whole = await client.chat.completions.create(**kw)
            events = [c async for c in await client.chat.completions.create(**kw, stream=True)]
    return whole, events


@pytest.mark.timeout(60)
def test_chat_reasoning_content_whole_and_streamed_with_a_clean_call() -> None:
    text = THOUGHT + CALL
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    tools = [{"type": "function", "function": {"name": "roll", "parameters": {"type": "object"}}}]
    whole, chunks = asyncio.run(
        _chat(pieces, model="stub", tools=tools, messages=[{"role": "user", "content": "Roll."}])
    )
    msg = whole.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nThe user wants a die <roll>.\n"
    assert msg.content is None and whole.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"sides": 6}
    thought, content, args = "", "", ""
    for c in chunks:
        d = c.choices[0].delta
        thought += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or ():
            args += t.function.arguments or ""
    assert thought == msg.model_extra["reasoning_content"]
    assert content == "" and args == msg.tool_calls[0].function.arguments


@pytest.mark.timeout(60)
def test_responses_reasoning_is_an_item_before_the_answer() -> None:
    pieces = [THOUGHT[:9], THOUGHT[9:], "Six", "."]
    whole, events = asyncio.run(_chat(pieces, model="stub", input="Roll."))
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "\nThe user wants a die <roll>.\n"
    assert whole.output[1].content[0].text == "Six."
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


@pytest.mark.timeout(60)
def test_parallel_tool_calls_false_returns_the_first_call_only() -> None:
    two = CALL + "\n" + CALL.replace("roll", "flip")
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("roll", "flip")
    ]
    kw: dict[str, Any] = dict(
        model="stub", tools=tools, messages=[{"role": "user", "content": "Go."}]
    )
    both, _ = asyncio.run(_chat([two], **kw))
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["roll", "flip"]
    first, chunks = asyncio.run(_chat([two], **kw, parallel_tool_calls=False))
    assert [c.function.name for c in first.choices[0].message.tool_calls] == ["roll"]
    streamed = {t.index for c in chunks for t in c.choices[0].delta.tool_calls or ()}
    assert streamed == {0}


def test_a_reasoning_input_item_reaches_the_next_assistant_turn() -> None:
    from dualpath.frontend.response_input import messages_of

    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    msgs = messages_of(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["reasoning_content"] == "hmm" and msgs[1]["tool_calls"][0]["id"] == "c1"
