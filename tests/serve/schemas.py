"""The JSON schemas the agent-API tests constrain replies with: bounded (``maxLength``,
``enum``, ``minimum`` / ``maximum``) so that even a random model ends a call within a few
dozen tokens, and every reply can be checked with ``jsonschema``."""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
LIST_FILES: dict[str, Any] = {
    "type": "object",
    "properties": {"dir": {"enum": ["src", "tests"]}},
    "required": ["dir"],
    "additionalProperties": False,
}
FUNCTIONS: dict[str, dict[str, Any]] = {"get_weather": WEATHER, "list_files": LIST_FILES}
