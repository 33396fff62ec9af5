"""Validation errors in our words (``schema.describe``): the field as OpenAI names it, what it
must be, never pydantic's wording or its union-member tags."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from dualpath.frontend.schema import ChatRequest, CompletionRequest, describe

ASK = [{"role": "user", "content": "hi"}]
CASES: list[tuple[type[BaseModel], dict[str, Any], str, str]] = [
    (CompletionRequest, {"prompt": "x", "echo": True}, "echo", "echo: must be false (got true)"),
    (
        ChatRequest,
        {"messages": [{"role": "user", "content": 5}]},
        "messages.0.content",
        "messages.0.content: must be a string or an array (got 5)",
    ),
    (
        ChatRequest,
        {"messages": ASK, "seed": -1},
        "seed",
        "seed: must be greater than or equal to 0 (got -1)",
    ),
    (
        ChatRequest,
        {"messages": [{"role": "bot", "content": "x"}]},
        "messages.0.role",
        'messages.0.role: must be "system", "developer", "user", "assistant" or "tool" (got "bot")',
    ),
    (ChatRequest, {}, "messages", "messages: is required"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_errors_name_the_field_in_our_words(case: int) -> None:
    model, data, param, message = CASES[case]
    with pytest.raises(ValidationError) as err:
        model.model_validate(data)
    got_message, got_param = describe(err.value)
    assert (got_message, got_param) == (message, param)
    assert "Input should" not in got_message and ".str" not in got_message
