"""Tool-call parsers per model family (``frontend/tool_families.py``), streamed or whole: the same
content and calls however the text is cut, argument deltas that concatenate to the whole-text
arguments, text that is not a call kept as content, and each family's forcing grammar."""

from __future__ import annotations

import json

import pytest

from dualpath.frontend.tool_families import TOOL_PARSERS, tool_parser_for
from dualpath.frontend.tools import Tool, grammar_error

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
)
WEATHER = Tool(
    "get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
)
# the same two calls as each family writes them
FAMILIES = {
    "hermes": HERMES,
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "ls", "parameters": {}}',
    "mistral": 'Let me look.\n\n[TOOL_CALLS][{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}, {"name": "ls", "arguments": {}}]',
    "deepseek_v3": "Let me look.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
    "<｜tool▁sep｜>ls\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "qwen3_coder": "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ls>\n</function>\n</tool_call>",
}


def _run(fmt: str, text: str, step: int, **kw: object) -> tuple[str, list[tuple[str, dict]]]:
    """Stream ``text`` in ``step``-character deltas; check the argument deltas add up to the
    calls' arguments; return the content and the calls."""
    p = TOOL_PARSERS[fmt]([WEATHER], **kw)  # type: ignore[arg-type]
    content, args, names = [], {}, {}
    for i in range(0, len(text), step):
        c, deltas = p.feed(text[i : i + step])
        content.append(c)
        for d in deltas:
            args[d.index] = args.get(d.index, "") + d.arguments
            names.setdefault(d.index, d.name)
    c, deltas = p.finish()
    content.append(c)
    for d in deltas:
        args[d.index] = args.get(d.index, "") + d.arguments
        names.setdefault(d.index, d.name)
    assert [args[i] for i in range(len(p.calls))] == [c.arguments for c in p.calls]
    assert [names[i] for i in range(len(p.calls))] == [c.name for c in p.calls]
    whole = TOOL_PARSERS[fmt]([WEATHER], **kw).parse(text)  # type: ignore[arg-type]
    assert whole[0] == "".join(content)
    assert [(c.name, c.arguments) for c in whole[1]] == [(c.name, c.arguments) for c in p.calls]
    return "".join(content), [(x.name, json.loads(x.arguments)) for x in p.calls]


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_each_family_parses_the_same_streamed_or_whole(fmt: str, step: int) -> None:
    content, calls = _run(fmt, FAMILIES[fmt], step)
    assert calls == [("get_weather", {"city": "Paris"}), ("ls", {})]
    assert content.strip() in ("Let me look.", "")


def test_arguments_stream_in_pieces() -> None:
    p = TOOL_PARSERS["hermes"]()
    pieces = [d.arguments for ch in HERMES for d in p.feed(ch)[1]]
    assert len([x for x in pieces if x]) > 5  # not one delta with the whole arguments


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    for fmt, text in FAMILIES.items():
        assert _run(fmt, text, 5, max_calls=1)[1] == [("get_weather", {"city": "Paris"})], fmt


def test_qwen3_coder_types_values_by_the_schema() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert _run("qwen3_coder", text, 4)[1] == [("get_weather", {"city": "42", "days": 3})]


def test_hermes_text_that_is_not_a_call_stays_content() -> None:
    text = "see <tool_call>not json</tool_call> and <tool_ca"
    assert _run("hermes", text, 2) == (text, [])
    assert _run("hermes", "a < b <tool", 1) == ("a < b <tool", [])


def test_hermes_an_unclosed_call_that_parses_is_a_call() -> None:
    content, calls = _run("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', 4)
    assert calls == [("f", {"x": 1})] and content == ""
    cut = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_ca'  # max_tokens cut the tag
    assert _run("hermes", cut, 3) == ("", [("f", {})])
    junk = '<tool_call>\n{"name": "f", "arguments": {}} and more'
    assert TOOL_PARSERS["hermes"]().parse(junk) == (junk, [])


def test_hermes_other_key_orders_and_string_arguments() -> None:
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    assert _run("hermes", text, 3)[1] == [("f", {"a": 1})]
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>'
    assert TOOL_PARSERS["hermes"]().parse(text)[1][0].arguments == '{"a": 2}'


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls(step: int) -> None:
    text = '{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}'
    assert _run("llama3_json", text, step) == ("", [("f", {"a": "x;y"}), ("g", {})])
    tagged = '<|python_tag|>{"name": "f", "parameters": {"q": 1}}'
    assert _run("llama3_json", tagged, step) == ("", [("f", {"q": 1})])


def test_llama3_json_plain_text_and_bad_json_stay_content() -> None:
    assert _run("llama3_json", "Hello {there}", 2) == ("Hello {there}", [])
    assert _run("llama3_json", '{"not": "a call"}', 3) == ('{"not": "a call"}', [])
    parser = TOOL_PARSERS["llama3_json"]()
    assert parser.parse('{"name": "f", "parameters": [1]}')[1] == []


def test_mistral_v11_named_calls() -> None:
    text = 'ok[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]ls[ARGS]{}'
    assert _run("mistral", text, 3) == ("ok", [("get_weather", {"city": "Rome"}), ("ls", {})])


def test_deepseek_v31_calls() -> None:
    text = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>ls<｜tool▁sep｜>{"d": 1}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert _run("deepseek_v3", text, 2) == ("", [("ls", {"d": 1})])


def test_auto_picks_the_family_from_the_template() -> None:
    assert tool_parser_for("{{ '<tool_call>' }}") == "hermes"
    assert tool_parser_for("<tool_call>\n<function=x>") == "qwen3_coder"
    assert tool_parser_for("[TOOL_CALLS]") == "mistral"
    assert tool_parser_for("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert tool_parser_for("<|python_tag|>") == "llama3_json"


@pytest.mark.parametrize("fmt", sorted(TOOL_PARSERS))
def test_call_grammar_is_valid_for_one_and_many_tools(fmt: str) -> None:
    a = Tool(
        "a", parameters={"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}
    )
    b = Tool(
        "b",
        parameters={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    )
    cls = TOOL_PARSERS[fmt]
    assert grammar_error(cls.call_grammar([a])) == ""
    assert grammar_error(cls.call_grammar([a, b])) == ""
    assert grammar_error('start: %json {"type": "nonsense"}') != ""
