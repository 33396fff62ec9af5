"""A request's tools and the calls parsed from a reply, and the JSON grammars that constrain
them (strict and bounded: ``frontend/strict.py``). The per-family formats and their parsers are
in ``frontend/tool_parsers.py`` and ``frontend/tool_families.py``. Pure: no I/O; llguidance only
builds grammar text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.frontend.strict import StrictSchema


@dataclass(frozen=True, slots=True)
class Tool:
    """One function tool of a request: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: Any = None  # a JSON-schema object (None: an object without arguments)
    strict: bool = True  # ``strict: false`` on the request's tool: extra keys allowed

    def schema(self) -> dict[str, Any]:
        """The schema as the request gave it (what the chat template renders)."""
        p = self.parameters
        return p if isinstance(p, dict) and p else {"type": "object"}

    def grammar_schema(self) -> dict[str, Any]:
        """The schema its calls are constrained to: strict unless the tool opts out, and
        bounded (``frontend/strict.py``)."""
        return StrictSchema(strict=self.strict).apply(self.schema())

    def openai(self) -> dict[str, Any]:
        """As chat templates take it (``tools=[{"type": "function", "function": …}]``)."""
        # description always there (as transformers' get_json_schema writes tools): templates
        # such as vLLM's hermes read it unguarded
        fn: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": self.schema(),
        }
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call: ``arguments`` is JSON text (as OpenAI returns it)."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def one_call_schema(tools: Sequence[Tool], args_key: str) -> dict[str, Any]:
    """The JSON schema of one call object ``{"name": …, args_key: {…}}`` of one of ``tools``
    (each tool's arguments strict and bounded, ``Tool.grammar_schema``)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.grammar_schema()},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def json_value(schema: dict[str, Any]) -> str:
    """A llguidance grammar item for one compact JSON value of ``schema`` (no free
    whitespace: even a random model ends within a few dozen tokens of a bounded schema)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def json_grammar(schema: Any, strict: bool = True) -> str:
    """llguidance grammar text for one JSON value matching ``schema`` (compact JSON; strict
    and bounded as ``frontend/strict.py`` makes it); None: ``json_object`` (a bounded object)."""
    import llguidance

    rules = StrictSchema(strict=strict)
    body = rules.free_object() if schema is None else rules.apply(schema)
    return str(
        llguidance.LLMatcher.grammar_from_json_schema(body, defaults={"whitespace_flexible": False})
    )


def grammar_error(grammar: str) -> str:
    """Why llguidance rejects ``grammar`` ('' when it is valid)."""
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(grammar))
