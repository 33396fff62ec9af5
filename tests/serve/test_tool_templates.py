"""Each tool-call family end to end on the real server, with a chat template in the checkpoint
written as vLLM's example templates are (hermes, llama 3.1 JSON, mistral; short equivalents,
not copies): ``--tool-parser auto`` picks the family from the template, a forced call comes
back parsed in that family's format, and its streamed argument deltas concatenate to the
non-streamed arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from tests.serve.conftest import ServerProc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# as vLLM's tool_chat_template_hermes.jinja: the description joined unguarded
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call functions. <tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool.function.name + ': ' + tool.function.description"
    " + ' ' + (tool.function.parameters | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nReturn <tool_call>\\n{"name": <name>, "arguments": <args>}\\n'
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# as vLLM's tool_chat_template_llama3.1_json.jinja: tools in the user turn, ipython results
LLAMA31 = (
    "{{- bos_token }}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython"
    "<|eot_id|>' }}{%- for m in messages %}{%- if m.role == 'user' and tools and loop.last %}"
    '{{- \'<|start_header_id|>user<|end_header_id|>\\n\\nRespond with {"name": function name, '
    '"parameters": dictionary of arguments}. Functions:\' }}{%- for t in tools %}'
    "{{- '\\n' + (t | tojson(indent=4)) }}{%- endfor %}{{- '\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + "
    "m.content + '<|eot_id|>' }}{%- else %}{{- '<|start_header_id|>' + m.role + "
    "'<|end_header_id|>\\n\\n' + (m.content or '') + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# as vLLM's tool_chat_template_mistral.jinja: [AVAILABLE_TOOLS] before the last user turn
MISTRAL = (
    "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + "
    "'[/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST]' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' }}"
    "{%- elif m.tool_calls %}{{- '[TOOL_CALLS]' + (m.tool_calls | tojson) + eos_token }}"
    "{%- else %}{{- (m.content or '') + eos_token }}{%- endif %}{%- endfor %}"
)
MARKERS = {"hermes": "<tool_call>\n{", "llama31": '{"name":', "mistral": "[TOOL_CALLS]["}
# LangChain's kind of schema: no additionalProperties, strings without bounds
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query", "limit"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},  # no description
    {
        "type": "function",
        "function": {
            "name": "noop",
            "description": "Nothing.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
ASK = [{"role": "user", "content": "Look up the weather."}]


@pytest.fixture(scope="module", params=["hermes", "llama31", "mistral"])
def templated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProc]:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp(request.param)
    ckpt = write_tiny_checkpoint(root / "model", arch="llama")
    cfg_path = Path(ckpt) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = {"hermes": HERMES, "llama31": LLAMA31, "mistral": MISTRAL}[request.param]
    cfg_path.write_text(json.dumps(cfg))
    server = ServerProc(
        ["--model-dir", str(ckpt), "--block-tokens", "16", "--kv-root", str(root / "kv")]
    )
    server.family, server.ckpt = request.param, ckpt  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        server.stop()


def test_a_forced_call_in_the_templates_format_parses_and_streams_the_same(
    templated: ServerProc,
) -> None:
    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kw: dict[str, Any] = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=700,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    from dualpath.frontend.tokenizer import HFTokenizer

    raw = HFTokenizer.from_dir(templated.ckpt).decode(choice.model_extra["token_ids"])  # type: ignore[attr-defined, index]
    assert raw.startswith(MARKERS[templated.family]), raw  # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]  # type: ignore[index]
    args = json.loads(call.function.arguments)
    if call.function.name == "lookup":  # strict: exactly its keys, bounded
        assert set(args) == {"query", "limit"} and len(args["query"]) <= 256
    else:
        assert call.function.name == "noop" and args == {}
    assert choice.message.content in (None, "")
    name, streamed = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            name += (d.function.name or "") if d.function else ""
            streamed += (d.function.arguments or "") if d.function else ""
    assert (name, streamed) == (call.function.name, call.function.arguments)
