"""The Responses API (``POST /v1/responses``): on the real server (DualPath runtime, a tiny
random Llama whose template renders tools) driven by the official `openai` client and the
OpenAI Agents SDK's default model; and, in process on a scripted backend, the stream's event
order and a backend failure mid-stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.frontend.stub import StubBackend  # noqa: E402
from tests.serve.conftest import ServerProc  # noqa: E402
from tests.serve.schemas import LIST_FILES, WEATHER  # noqa: E402

from dualpath.frontend.backend import BackendFailure, GenerateRequest, TokenEvent  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny-llama"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Forecast.",
        "parameters": WEATHER,
        "strict": True,
    },
    {"type": "function", "name": "list_files", "parameters": LIST_FILES, "strict": True},
]
ASK = "What is the weather in Paris this week?"


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def _schema_of(name: str) -> Any:
    return next(t["parameters"] for t in TOOLS if t["name"] == name)


def test_text_whole_and_streamed_agree_and_equal_chat(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    kw: dict[str, Any] = dict(
        model=MODEL, input=ASK, instructions="Be terse.", temperature=0, max_output_tokens=10
    )
    # warm the cache first: the runs compared below then prefill the same uncached tail (a
    # cold and a cached prefill compute in other shapes, and need not agree to the last bit)
    client.responses.create(**kw)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    [item] = whole.output
    assert item.type == "message" and item.role == "assistant" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 10
    assert whole.usage.total_tokens == whole.usage.input_tokens + 10
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=10,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": ASK}],
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == whole.usage.input_tokens
    assert chat.choices[0].message.content == whole.output_text  # the same tokens

    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, 10)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_function_call_is_schema_valid_whole_and_streamed(
    hf_server: ServerProc, choice: str
) -> None:
    client = _client(hf_server)
    tool_choice: Any = (
        "required" if choice == "required" else {"type": "function", "name": "list_files"}
    )
    kw: dict[str, Any] = dict(
        model=MODEL,
        input=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_output_tokens=160,
    )
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    if choice == "named":
        assert call.name == "list_files"
    jsonschema.validate(json.loads(call.arguments), _schema_of(call.name))
    if choice == "required":
        assert whole.tool_choice == "required"
    else:
        assert whole.tool_choice.name == "list_files"  # type: ignore[union-attr]

    events = list(client.responses.create(**kw, stream=True))
    assert [e.type for e in events][2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    delta, done = events[3], events[4]
    assert delta.delta == done.arguments == call.arguments  # type: ignore[union-attr]
    item = events[5].item  # type: ignore[union-attr]
    assert (item.name, item.arguments, item.status) == (call.name, call.arguments, "completed")


def test_a_function_call_output_goes_back_into_the_prompt(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    args = '{"city": "Paris", "unit": "celsius", "days": 3}'
    history: list[Any] = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": args,
            "id": "fc_1",
            "status": "completed",
        },
    ]
    result = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C."}
    kw: dict[str, Any] = dict(model=MODEL, tools=TOOLS, max_output_tokens=1)
    without = client.responses.create(input=history, **kw)
    with_output = client.responses.create(input=[*history, result], **kw)
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=1,
        tools=[
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "parameters")}
                | ({"description": t["description"]} if "description" in t else {}),
            }
            for t in TOOLS
        ],
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
        ],
    )
    assert without.usage is not None and with_output.usage is not None and chat.usage is not None
    assert with_output.usage.input_tokens == chat.usage.prompt_tokens
    assert with_output.usage.input_tokens > without.usage.input_tokens + 5


def test_text_format_json_schema_output_validates(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    for temperature in (0.0, 1.0):
        r = client.responses.create(
            model=MODEL,
            input=ASK,
            text={"format": fmt},
            temperature=temperature,
            max_output_tokens=120,
        )
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), WEATHER)
        assert r.text is not None and r.text.format.type == "json_schema"


def test_output_text_logprobs_when_included(hf_server: ServerProc) -> None:
    r = _client(hf_server).responses.create(
        model=MODEL,
        input=ASK,
        temperature=0,
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == 4
    assert all(
        len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob
        for lp in part.logprobs
    )  # greedy: the chosen token is the top one
    assert "".join(lp.token for lp in part.logprobs) == r.output_text


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include.0"),
        ({"truncation": "auto"}, "truncation"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "no"}}},
                    }
                }
            },
            "text.format",
        ),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ],
)
def test_what_it_cannot_honour_is_a_400_naming_the_field(
    hf_server: ServerProc, extra: dict[str, Any], named: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": ASK, "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        _client(hf_server).post("/responses", cast_to=object, body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert str(error["param"]).startswith(named) and error["message"].startswith(named)


# -- the Agents SDK's default model ---------------------------------------------------------


def _agents_model(server: ServerProc) -> Any:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=60
    )
    return agents.OpenAIResponsesModel(model=MODEL, openai_client=client)


def test_an_agents_sdk_agent_calls_its_tool_then_answers_from_its_result(
    hf_server: ServerProc,
) -> None:
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        done: bool
        note: str = Field(max_length=8)

    calls: list[str] = []

    @agents.function_tool
    def list_files(dir: Literal["src", "tests"]) -> str:
        """List the files of a directory of the repository.

        Args:
            dir: the directory.
        """
        calls.append(dir)
        return "main.py test_main.py"

    settings = agents.ModelSettings(tool_choice="required", max_tokens=160, temperature=0)
    agent = agents.Agent(
        name="coder",
        instructions="You are a coding agent. Use your tools.",
        tools=[list_files],
        model=_agents_model(hf_server),
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    answer = agent.clone(
        output_type=Verdict,
        model_settings=agents.ModelSettings(tool_choice="none", max_tokens=160, temperature=0),
    )

    async def both() -> tuple[Any, Any]:  # one event loop: the client's connections live on it
        first = await agents.Runner.run(agent, "Which files are in src?", max_turns=2)
        # the next turn sends the call and its output back (the SDK's items): a final answer
        run = agents.Runner.run_streamed(answer, first.to_input_list(), max_turns=2)
        async for _ in run.stream_events():
            pass
        return first, run

    first, second = asyncio.run(both())
    assert calls in (["src"], ["tests"])  # schema-valid: the enum
    assert [type(i).__name__ for i in first.new_items] == ["ToolCallItem", "ToolCallOutputItem"]
    assert first.final_output == "main.py test_main.py"
    assert isinstance(second.final_output, Verdict) and len(calls) == 1
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[0].usage.input_tokens


def test_an_agents_sdk_agent_on_default_tool_choice_finishes(hf_server: ServerProc) -> None:
    agents = pytest.importorskip("agents")
    calls: list[int] = []

    @agents.function_tool
    def roll(sides: Literal[6, 20]) -> str:
        """Roll a die.

        Args:
            sides: how many sides the die has.
        """
        calls.append(sides)
        return "4"

    agent = agents.Agent(
        name="player",
        instructions="Play.",
        tools=[roll],
        model=_agents_model(hf_server),
        output_type=bool,
        model_settings=agents.ModelSettings(max_tokens=160, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(agents.Runner.run(agent, "Roll if you want to.", max_turns=2))
    # auto: the (random) model either calls the tool (the run stops on it) or answers
    assert result.final_output == "4" if calls else isinstance(result.final_output, bool)
    assert all(c in (6, 20) for c in calls) and len(result.raw_responses) == 1


# -- in process: a scripted reply --------------------------------------------------------------


class ScriptBackend(StubBackend):
    """Replies with ``pieces`` one event each; ``fail_after``: raises the backend failure
    after that many events."""

    def __init__(self, pieces: list[str], fail_after: int | None = None) -> None:
        super().__init__()
        self.pieces, self.fail_after = pieces, fail_after

    def generate(self, request: object) -> AsyncIterator[TokenEvent]:  # type: ignore[override]
        assert isinstance(request, GenerateRequest)
        return self._events(len(request.prompt_tokens))

    async def _events(self, num_prompt_tokens: int) -> AsyncIterator[TokenEvent]:
        for k, piece in enumerate(self.pieces):
            if k == self.fail_after:
                raise BackendFailure("the engine died")
            last = k == len(self.pieces) - 1
            yield TokenEvent((k,), piece, num_prompt_tokens, 0, k + 1, "stop" if last else None)


async def _scripted(backend: ScriptBackend, **kw: Any) -> tuple[Any, list[Any]]:
    import httpx2

    from dualpath.frontend.api import create_app

    transport = httpx2.ASGITransport(app=create_app(backend))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
        )
        whole = None if backend.fail_after is not None else await client.responses.create(**kw)
        events = [e async for e in await client.responses.create(**kw, stream=True)]
    return whole, events


def _without_ids(items: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in i.model_dump().items() if k not in ("id", "call_id")} for i in items]


@pytest.mark.timeout(60)
def test_text_and_calls_become_items_in_order_whole_equal_to_streamed() -> None:
    call = '<tool_call>\n{"name": "roll", "arguments": {"sides": 6}}\n</tool_call>'
    pieces = ["Let me ", "roll. ", call[:20], call[20:], " Done."]
    tools = [{"type": "function", "name": "roll", "parameters": {"type": "object"}}]
    whole, events = asyncio.run(
        _scripted(ScriptBackend(pieces), model="stub", input="Roll.", tools=tools)
    )
    assert [i.type for i in whole.output] == ["message", "function_call", "message"]
    assert [i.content[0].text for i in whole.output if i.type == "message"] == [
        "Let me roll. ",
        " Done.",
    ]
    assert whole.output[1].name == "roll" and json.loads(whole.output[1].arguments) == {"sides": 6}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed"
    assert _without_ids(final.response.output) == _without_ids(whole.output)
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == [0, 1, 2]  # each item closes before the next opens


@pytest.mark.timeout(60)
def test_a_backend_failure_mid_stream_is_a_response_failed_event_then_the_end() -> None:
    _, events = asyncio.run(
        _scripted(ScriptBackend(["Hello ", "world"], fail_after=1), model="stub", input="Hi")
    )
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "the engine died" in failed.error.message
