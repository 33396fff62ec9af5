"""The OpenAI request bodies the server accepts (pydantic), and its error shape.

Every top-level field is either honoured or refused: an unknown or unsupported field is a 400
that names it (``unsupported_fields``), never silently ignored; inside messages and tools,
fields that do not change the answer (``refusal``, ``annotations``, …) are ignored, as
OpenAI's own server does. ``docs/serving.md`` has the table of every field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_TOKENS = 2**31 - 1  # far past any context length: a bigger value is named as the error
MAX_SEED = 2**63 - 1  # a seed is a non-negative int64 (what torch generators take)
MAX_N = 16  # parallel samples per request
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_LOGIT_BIAS = 1024  # entries


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "server_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _KINDS.get(status, "invalid_request_error"),
            "param": param,
            "code": None,
        }
    }


_KIND_WORDS = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}
_BOUND_WORDS = {
    "greater_than_equal": ("greater than or equal to", "ge"),
    "less_than_equal": ("less than or equal to", "le"),
    "greater_than": ("greater than", "gt"),
    "less_than": ("less than", "lt"),
}


def _json_words(text: str) -> str:
    """pydantic's Python spellings of expected values as JSON writes them."""
    text = text.replace("False", "false").replace("True", "true").replace("None", "null")
    return text.replace("'", '"')


def _expected(err: Any) -> str:
    """What a field must be, in our words (never pydantic's)."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _KIND_WORDS:
        return f"must be {_KIND_WORDS[kind]}"
    if kind in _BOUND_WORDS:
        words, key = _BOUND_WORDS[kind]
        return f"must be {words} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be {_json_words(str(ctx.get('expected', '')))}"
    if kind == "missing":
        return "is required"
    if kind == "too_short":
        return f"must have at least {ctx.get('min_length')} item(s)"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} item(s)"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}"
    return "is invalid"


def _field_path(loc: tuple[Any, ...]) -> str:
    """A location without pydantic's union-member tags (``content.str``, ``function-after``,
    ``list[ContentPart]``, ``literal['auto','none']``): only field names and indices."""
    parts = []
    for p in loc:
        text = str(p)
        if isinstance(p, str) and ("[" in text or "-" in text or text in _UNION_TAGS):
            continue
        parts.append(text)
    return ".".join(parts)


_UNION_TAGS = frozenset(
    {"str", "int", "float", "bool", "list", "dict", "none"}
    | {"ContentPart", "NamedToolChoice", "FunctionCallIn"}
)


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """The first invalid field and what it must be: ``(message, param)`` in our words (a
    union's alternatives joined with "or")."""
    errors = exc.errors()
    where = _field_path(tuple(errors[0]["loc"]))
    wants = []
    for err in errors:
        if _field_path(tuple(err["loc"])) == where and _expected(err) not in wants:
            wants.append(_expected(err))
    text = " or ".join([wants[0], *(w.removeprefix("must be ") for w in wants[1:])])
    got = errors[0].get("input")
    if (
        errors[0]["type"] != "missing"
        and isinstance(got, (str, int, float, bool))
        and len(str(got)) < 40
    ):
        text += f" (got {json.dumps(got)})"
    return (f"{where}: {text}" if where else text), where or None


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class ContentPart(_Base):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCallIn(_Base):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Base):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's (as vLLM returns it)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Base):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Base):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class Document(BaseModel):
    """A retrieved document for templates that render ``documents`` (RAG)."""

    model_config = ConfigDict(extra="allow")
    title: str = ""
    text: str


class JsonSchemaFormat(_Base):
    name: str = "response"
    description: str = ""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(_Base):
    """Fields common to chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # an extension (as vLLM's): each choice's output token ids
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    metadata: dict[str, str] | None = None  # kept with nothing: never changes the answer
    store: Literal[False] | None = None  # nothing is stored; store=true is refused
    service_tier: Literal["auto", "default"] | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # extensions, as vLLM's (transformers' apply_chat_template arguments)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Document] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


def unsupported_fields(data: dict[str, Any], model: type[BaseModel]) -> str | None:
    """The first top-level field of ``data`` that ``model`` does not know, if any."""
    known = set(model.model_fields)
    for f in model.model_fields.values():
        if f.alias:
            known.add(f.alias)
    for key in data:
        if key not in known:
            return key
    return None
