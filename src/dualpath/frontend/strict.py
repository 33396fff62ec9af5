"""JSON schemas as constrained decoding serves them (``StrictSchema``): strict mode (an object
without ``additionalProperties`` allows no key beyond its ``properties``, as xgrammar's
default strict mode does in vLLM), and bounds where the schema
gives none (strings ``maxLength``, arrays ``maxItems``, integers a range), so that a forced
call or a JSON reply always closes, whatever the model samples. ``json_object`` is a bounded
object of the same kind. Pure: dict in, new dict out; the input is never changed.

llguidance offers no option for either (its ``x-guidance`` keys are whitespace, separators,
escapes, ``coerce_one_of``, ``lenient``), so the schema itself is rewritten, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_STRING_SHAPED = ("maxLength", "enum", "const", "pattern", "format")
MAP_KEY = r"^[A-Za-z0-9_.-]{1,32}$"  # the keys of a free object (json_object)


@dataclass(frozen=True, slots=True)
class StrictSchema:
    """``strict``: missing ``additionalProperties`` means false (``strict: false`` on a tool
    or a ``json_schema`` turns it off); the ``max_*`` bounds apply either way, to strings,
    arrays and integers that give none (the request's own bounds always win)."""

    strict: bool = True
    max_string_chars: int = 256
    max_array_items: int = 16
    max_integer: int = 2**53  # |value|: JavaScript's exact integers
    max_object_keys: int = 16  # a free object's (json_object)

    def __post_init__(self) -> None:
        for name in ("max_string_chars", "max_array_items", "max_integer", "max_object_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")

    def apply(self, schema: Any) -> Any:
        """``schema`` rewritten (see the class docstring); booleans and non-schemas as given."""
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        for key in _SUBSCHEMA_MAPS:
            sub = out.get(key)
            if isinstance(sub, dict):
                out[key] = {k: self.apply(v) for k, v in sub.items()}
        for key in _SUBSCHEMA_LISTS:
            sub = out.get(key)
            if isinstance(sub, list):
                out[key] = [self.apply(v) for v in sub]
        for key in _SUBSCHEMA_ONES:
            if isinstance(out.get(key), dict):
                out[key] = self.apply(out[key])
        types = out.get("type")
        kinds = set(types) if isinstance(types, list) else {types}
        is_object = "object" in kinds or "properties" in out or "patternProperties" in out
        if self.strict and is_object and "additionalProperties" not in out:
            out["additionalProperties"] = False  # (a bare {"type": "object"}: only {})
        if "string" in kinds and not any(k in out for k in _STRING_SHAPED):
            out["maxLength"] = self.max_string_chars
        if "array" in kinds and "maxItems" not in out:
            out["maxItems"] = max(self.max_array_items, int(out.get("minItems", 0)))
        if "integer" in kinds and kinds <= {"integer", "null"}:
            out.setdefault("minimum", -self.max_integer)
            out.setdefault("maximum", self.max_integer)
        return out

    def free_object(self) -> dict[str, Any]:
        """``json_object``: an object of up to ``max_object_keys`` keys (``MAP_KEY``) whose
        values are bounded scalars, arrays of them, or one more level of such objects."""
        scalar: list[Any] = [
            {"type": "string", "maxLength": self.max_string_chars},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
        ]
        array = {"type": "array", "items": {"anyOf": scalar}, "maxItems": self.max_array_items}
        inner = self._map({"anyOf": [*scalar, array]})
        return self._map({"anyOf": [*scalar, array, inner]})

    def _map(self, value: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "patternProperties": {MAP_KEY: value},
            "additionalProperties": False,
            "maxProperties": self.max_object_keys,
        }
