"""Tool-call parsing (hermes, llama3_json), streamed or whole, and the call grammar."""

from __future__ import annotations

import json

import pytest

from dualpath.serve.tools import Tool, ToolParser, call_grammar, grammar_error

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
)


def _run(fmt: str, text: str, step: int) -> tuple[str, list[tuple[str, dict]]]:
    p = ToolParser(fmt)
    content, calls = [], []
    for i in range(0, len(text), step):
        c, k = p.feed(text[i : i + step])
        content.append(c)
        calls.extend(k)
    c, k = p.finish()
    content.append(c)
    calls.extend(k)
    return "".join(content), [(x.name, json.loads(x.arguments)) for x in calls]


@pytest.mark.parametrize("step", [1, 3, 7, len(HERMES)])
def test_hermes_calls_parse_the_same_streamed_or_whole(step: int) -> None:
    content, calls = _run("hermes", HERMES, step)
    assert calls == [("get_weather", {"city": "Paris"}), ("ls", {})]
    assert content == "Let me look.\n\n"


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
    assert _run("hermes", junk, 3) == (junk, [])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_llama3_json_calls(step: int) -> None:
    text = '{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}'
    assert _run("llama3_json", text, step) == ("", [("f", {"a": "x;y"}), ("g", {})])
    tagged = '<|python_tag|>{"name": "f", "parameters": {"q": 1}}'
    assert _run("llama3_json", tagged, step) == ("", [("f", {"q": 1})])


def test_llama3_json_plain_text_and_bad_json_stay_content() -> None:
    assert _run("llama3_json", "Hello {there}", 2) == ("Hello {there}", [])
    assert _run("llama3_json", '{"name": "f", "parameters": [1]}', 3)[1] == []
    assert _run("llama3_json", '{"not": "a call"}', 3) == ('{"not": "a call"}', [])


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="tool format 'xml' is invalid"):
        ToolParser("xml")


def test_call_grammar_is_valid_for_one_and_many_tools() -> None:
    a = Tool("a", parameters={"type": "object", "properties": {"x": {"enum": [1, 2]}}})
    b = Tool("b")
    for fmt in ("hermes", "llama3_json"):
        assert grammar_error(call_grammar([a], fmt)) == ""
        assert grammar_error(call_grammar([a, b], fmt)) == ""
    assert grammar_error('start: %json {"type": "nonsense"}') != ""
