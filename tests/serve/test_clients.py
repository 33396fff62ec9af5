"""The agent frameworks' own calls against the real server (a tiny random Llama, constrained by
llguidance): LangChain's ``bind_tools`` and ``with_structured_output`` with the schemas it
writes (no ``additionalProperties``, unbounded strings: strict mode and the bounds make every
call close), and the OpenAI Agents SDK's default model (Responses) with a tool and an output
type."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from tests.serve.conftest import ServerProc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "tiny-llama"


class Forecast(pydantic.BaseModel):
    """The forecast for a zone."""

    zone: str
    days: int


def _chat_model(server: ServerProc) -> Any:
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=120,
        temperature=0,
        max_tokens=700,
    )


@pytest.mark.parametrize("choice", ["any", "Forecast"])
def test_langchain_bind_tools_forces_a_parsed_call(hf_server: ServerProc, choice: str) -> None:
    model = _chat_model(hf_server).bind_tools([Forecast], tool_choice=choice)
    reply = model.invoke("What is the weather in Paris?")
    assert len(reply.tool_calls) == 1, reply
    call = reply.tool_calls[0]
    assert call["name"] == "Forecast"
    Forecast.model_validate(call["args"])  # strict: exactly its keys, of its types


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_structured_output_in_every_method(hf_server: ServerProc, method: str) -> None:
    schema: Any = Forecast
    if method == "json_mode":  # json_object: any (bounded) object; LangChain parses it
        schema = {
            "title": "Forecast",
            "type": "object",
            "description": "A forecast.",
            "properties": {"zone": {"type": "string"}},
        }
    model = _chat_model(hf_server).with_structured_output(schema, method=method)
    out = model.invoke("Forecast for Paris, as JSON.")
    if method == "json_mode":
        assert isinstance(out, dict)
    else:
        assert isinstance(out, Forecast)


def test_agents_sdk_default_responses_model_runs_a_tool_and_an_output_type(
    hf_server: ServerProc,
) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def list_files(dir: Literal["src", "tests"]) -> str:
        """List the files of a directory.

        Args:
            dir: the directory.
        """
        calls.append(dir)
        return "main.py"

    client = openai.AsyncOpenAI(
        base_url=hf_server.url + "/v1", api_key="sk-test", max_retries=0, timeout=120
    )
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(max_tokens=700, temperature=0)
    # the tool turn: forced (with tool_choice auto the random model, offered a call or the
    # output type's JSON, always picks the call: a real model answers when it is done)
    caller = agents.Agent(
        name="coder",
        instructions="Use your tools.",
        tools=[list_files],
        model=model,
        tool_use_behavior="stop_on_first_tool",
        model_settings=settings.resolve(agents.ModelSettings(tool_choice="required")),
    )
    # the answer turn: the history (a function call and its output) back in, an output type
    answerer = agents.Agent(
        name="coder",
        instructions="Answer.",
        tools=[list_files],
        output_type=Forecast,
        model=model,
        model_settings=settings.resolve(agents.ModelSettings(tool_choice="none")),
    )

    async def both() -> tuple[Any, Any]:
        first = await agents.Runner.run(caller, "Which files are in src?", max_turns=2)
        history = [*first.to_input_list(), {"role": "user", "content": "Now the forecast."}]
        return first, await agents.Runner.run(answerer, history, max_turns=2)

    first, result = asyncio.run(both())
    assert len(calls) == 1 and calls[0] in ("src", "tests")
    assert first.final_output == "main.py"
    assert isinstance(result.final_output, Forecast)
