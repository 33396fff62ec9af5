"""Strict, bounded schemas (``frontend/strict.py``): what the rewrite adds, and that the grammars
built from them refuse extra keys and unbounded values (checked with llguidance's matcher)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dualpath.frontend.strict import StrictSchema
from dualpath.frontend.tool_families import Hermes
from dualpath.frontend.tools import Tool, json_grammar
from dualpath.runtime.token_choice import build_tokenizer
from dualpath.tokens import VocabSpec

llguidance = pytest.importorskip("llguidance")

BYTES = VocabSpec(
    tokens=(*(bytes([i]) for i in range(256)), b"<eos>"), special_ids=(256,), eos_token_ids=(256,)
)
# LangChain's schema of a pydantic model: no additionalProperties, strings without bounds
LANGCHAIN: dict[str, Any] = {
    "type": "object",
    "properties": {
        "zone": {"type": "string", "description": "The zone."},
        "tags": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "integer"},
        "sub": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}}},
    },
    "required": ["zone"],
}


def _byte_matcher_accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts exactly ``text``, fed one byte per token."""
    tokenizer = build_tokenizer(BYTES, 257)
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(b) for b in text.encode()) and bool(m.is_accepting())


def test_strict_mode_closes_every_object_and_bounds_values() -> None:
    out = StrictSchema().apply(LANGCHAIN)
    assert out["additionalProperties"] is False
    assert out["properties"]["sub"]["additionalProperties"] is False
    assert out["properties"]["zone"]["maxLength"] == 256
    assert out["properties"]["sub"]["properties"]["x"]["maxLength"] == 3  # the request's own
    assert out["properties"]["tags"]["maxItems"] == 16
    assert out["properties"]["tags"]["items"]["maxLength"] == 256
    assert out["properties"]["count"]["maximum"] == 2**53
    assert "additionalProperties" not in LANGCHAIN  # the input is never changed


def test_strict_false_keeps_extra_keys_but_still_bounds() -> None:
    out = StrictSchema(strict=False).apply(LANGCHAIN)
    assert "additionalProperties" not in out
    assert out["properties"]["zone"]["maxLength"] == 256
    explicit = StrictSchema().apply({"type": "object", "additionalProperties": True})
    assert explicit["additionalProperties"] is True  # what the request says wins


def test_a_forced_call_grammar_refuses_extra_keys_unless_the_tool_opts_out() -> None:
    call = '<tool_call>\n{"name":"f","arguments":{"zone":"a","extra":1}}\n</tool_call>'
    ok = '<tool_call>\n{"name":"f","arguments":{"zone":"a"}}\n</tool_call>'
    strict = Hermes.call_grammar([Tool("f", parameters=LANGCHAIN)])
    assert _byte_matcher_accepts(strict, ok)
    assert not _byte_matcher_accepts(strict, call)
    loose = Hermes.call_grammar([Tool("f", parameters=LANGCHAIN, strict=False)])
    assert _byte_matcher_accepts(loose, call)


def test_strings_are_bounded_in_the_grammar() -> None:
    g = json_grammar({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    assert _byte_matcher_accepts(g, json.dumps({"s": "x" * 256}, separators=(",", ":")))
    assert not _byte_matcher_accepts(g, json.dumps({"s": "x" * 257}, separators=(",", ":")))


def test_json_object_is_a_bounded_object() -> None:
    g = json_grammar(None)
    small = {"a": 1, "b": [True, None, "x"], "c": {"d": "e"}}
    assert _byte_matcher_accepts(g, json.dumps(small, separators=(",", ":")))
    many = {f"k{i}": i for i in range(17)}
    assert not _byte_matcher_accepts(g, json.dumps(many, separators=(",", ":")))
    assert not _byte_matcher_accepts(g, json.dumps({"k" * 33: 1}, separators=(",", ":")))
    assert not _byte_matcher_accepts(g, "[1]")


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match="max_string_chars=0"):
        StrictSchema(max_string_chars=0)
