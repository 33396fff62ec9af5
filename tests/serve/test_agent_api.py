"""Acceptance of the agent API on the real server (DualPath runtime, a tiny random Llama whose
chat template renders tools), driven as agent frameworks drive it: the official `openai`
client and the OpenAI Agents SDK's chat-completions model. A random model still produces
schema-valid calls and JSON because the engines constrain decoding (llguidance)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Literal

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import ServerProc  # noqa: E402
from tests.serve.schemas import LIST_FILES, WEATHER  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny-llama"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "list_files", "parameters": LIST_FILES}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]
# as the server hands tools to the template (a description always there, as transformers'
# get_json_schema writes one)
RENDERED = tuple(
    {
        "type": "function",
        "function": {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "parameters": t["function"]["parameters"],
        },
    }
    for t in TOOLS
)


def _client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def _schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_tools_reach_the_prompt_as_the_template_renders_them(
    hf_server: ServerProc, hf_checkpoint: Path
) -> None:
    from dualpath.frontend.tokenizer import ChatInputs, HFTokenizer

    tok = HFTokenizer.from_dir(hf_checkpoint)
    inputs = ChatInputs(tools=RENDERED)
    client = _client(hf_server)
    with_tools = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    expected = len(tok.encode(tok.render_chat(ASK, inputs)))
    assert with_tools.usage is not None and plain.usage is not None
    assert with_tools.usage.prompt_tokens == expected > plain.usage.prompt_tokens + 100
    # an assistant's tool_calls and a tool result are rendered too
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 3}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1)
    rendered = tok.render_chat(
        [
            *history[:1],
            {
                **history[1],
                "tool_calls": [
                    {
                        **history[1]["tool_calls"][0],
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "unit": "celsius", "days": 3},
                        },
                    }
                ],
            },
            history[2],
        ],
        inputs,
    )
    assert "Sunny, 21 C." in rendered and '"city": "Paris"' in rendered
    assert r.usage is not None and r.usage.prompt_tokens == len(tok.encode(rendered))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_schema_valid_and_streams_to_the_same_call(
    hf_server: ServerProc, choice: str
) -> None:
    client = _client(hf_server)
    tool_choice: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "list_files"}}
    )
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=120,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    if choice == "named":
        assert call.function.name == "list_files"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
    assert call.id.startswith("call_") and call.type == "function"
    parts: dict[int, dict[str, str]] = {}
    finish, num_arg_deltas = None, 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += (d.function.name or "") if d.function else ""
            p["arguments"] += (d.function.arguments or "") if d.function else ""
            num_arg_deltas += bool(d.function and d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert num_arg_deltas > 1  # the arguments stream as they are written, not in one piece
    assert finish == "tool_calls"
    assert parts == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_response_format_json_schema_and_json_object(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format=fmt,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), WEATHER)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content or ""
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                },
            },
        )


def test_n_samples_are_the_seeded_single_samples(hf_server: ServerProc) -> None:
    client = _client(hf_server)
    kw: dict[str, Any] = dict(
        model=MODEL, messages=ASK, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    two = client.chat.completions.create(**kw, n=2, seed=7)
    assert [c.index for c in two.choices] == [0, 1]
    one = [client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (7, 8)]
    assert [c.message.content for c in two.choices] == one
    assert two.usage is not None and two.usage.completion_tokens == 16
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kw, n=2, seed=7, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert list(streamed.values()) == one


def test_logprobs_match_a_direct_forward_pass(hf_server: ServerProc, hf_checkpoint: Path) -> None:
    import torch
    import transformers

    from dualpath.frontend.tokenizer import HFTokenizer

    client = _client(hf_server)
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    tok = HFTokenizer.from_dir(hf_checkpoint)
    prompt = tok.encode(tok.render_chat(ASK))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_checkpoint)).eval()
    out = []
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # greedy, as the server ran
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            t = int(logp.argmax())
            out.append((t, float(logp[t]), [float(v) for v in logp.topk(3).values]))
            ids.append(t)
    for entry, (t, lp, top) in zip(content, out, strict=True):
        assert entry.token == tok.decode([t])
        assert entry.logprob == pytest.approx(lp, abs=2e-3)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top, abs=2e-3)
    c = client.completions.create(
        model=MODEL,
        prompt="Run the tests",
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 3 and len(lp.top_logprobs or []) == 3


def test_logit_bias_steers_greedy_decoding(hf_server: ServerProc, hf_checkpoint: Path) -> None:
    from dualpath.frontend.tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(hf_checkpoint)
    client = _client(hf_server)
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    forced = client.chat.completions.create(**kw, logit_bias={"42": 100})
    texts = [e.token for e in forced.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert texts == [tok.decode([42])] * 5
    base = client.chat.completions.create(**kw)
    first = base.choices[0].logprobs.content[0].token  # type: ignore[union-attr]
    first_id = tok.encode(first)[0]
    banned = client.chat.completions.create(**kw, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(**kw, logit_bias={"999999": 1})


def test_errors_are_openai_shaped(hf_server: ServerProc) -> None:
    h = hf_server.auth_headers
    r = httpx.get(hf_server.url + "/v1/nope", headers=h)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(hf_server.url + "/v1/chat/completions", headers=h)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    client = _client(hf_server)
    with pytest.raises(openai.BadRequestError, match="tool_choice: no tool named 'nope'"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=2,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="modalities: not supported"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=2, extra_body={"modalities": ["audio"]}
        )
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=2,
            tool_choice="required",
            extra_body={"ignore_eos": True},
        )


def test_an_agents_sdk_agent_calls_its_tool_and_finishes(hf_server: ServerProc) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @agents.function_tool
    def list_files(dir: Literal["src", "tests"]) -> str:
        """List the files of a directory of the repository.

        Args:
            dir: the directory, src or tests.
        """
        calls.append({"dir": dir})
        return "main.py test_main.py"

    model = agents.OpenAIChatCompletionsModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(
            base_url=hf_server.url + "/v1", api_key="sk-test", max_retries=0, timeout=60
        ),
    )
    agent = agents.Agent(
        name="coder",
        instructions="You are a coding agent. Use your tools.",
        tools=[list_files],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
    )  # reset_tool_choice (the default): after the call, tool_choice is auto again

    result = asyncio.run(agents.Runner.run(agent, "Which files are in src?", max_turns=4))
    assert len(calls) == 1 and calls[0]["dir"] in ("src", "tests")
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    first, last = result.raw_responses[0], result.raw_responses[-1]
    assert first.usage.input_tokens < last.usage.input_tokens  # the tool result went back
    assert isinstance(result.final_output, str)
