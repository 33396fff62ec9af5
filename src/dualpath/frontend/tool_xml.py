"""The qwen3_coder tool-call format (Qwen3-Coder's XML): ``<tool_call>\\n<function=NAME>\\n
<parameter=KEY>\\nVALUE\\n</parameter>\\n…</function>\\n</tool_call>``. A value is typed by its
tool's schema (a string stays text; anything else is read as JSON, else kept as text); the
arguments stream as ``json.dumps`` of the object, one parameter at a time. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from dualpath.frontend.tool_parsers import PENDING, PartialCall, Scan, ToolParser, tagged
from dualpath.frontend.tools import Tool, json_value

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


class Qwen3Coder(ToolParser):
    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        return tagged(text, final, self.OPEN, self.CLOSE, self._read)

    def _read(self, body: str, complete: bool) -> PartialCall | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None if complete or len(body.strip()) > len("<function=") + 64 else PENDING
        name, pos, pieces = m.group(1).strip(), m.end(), []
        while (p := _PARAM.match(body, pos)) is not None:
            key, value = p.group(1).strip(), self._value(name, p.group(1).strip(), p.group(2))
            pieces.append(
                f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            )
            pos = p.end()
        args = "{" + ", ".join(pieces)
        if body[pos:].strip().startswith(_FUNCTION_END):
            return PartialCall(name, args + "}", done=True)
        return None if complete else PartialCall(name, args)

    def _value(self, function: str, key: str, text: str) -> Any:
        tool = self.tools.get(function)
        props = tool.schema().get("properties", {}) if tool is not None else {}
        kind = props.get(key, {}).get("type") if isinstance(props.get(key), dict) else None
        if kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        """One call: each required parameter of its tool once, in the schema's order (a
        string as text without ``<``, anything else as JSON of its schema)."""
        rules, names = [], []
        for i, t in enumerate(tools):
            schema = t.grammar_schema()
            props = schema.get("properties", {})
            parts = [f'"<function={t.name}>\\n"']
            for k, key in enumerate(schema.get("required", [])):
                sub = props.get(key, {})
                if isinstance(sub, dict) and sub.get("type") == "string" and "enum" not in sub:
                    limit = int(sub.get("maxLength", 256))
                    value = f"/[^<]{{0,{limit}}}/"
                else:
                    rules.append(f"v{i}_{k}: {json_value(sub if isinstance(sub, dict) else {})}")
                    value = f"v{i}_{k}"
                parts.append(f'"<parameter={key}>\\n" {value} "\\n</parameter>\\n"')
            rules.append(f'c{i}: {" ".join(parts)} "</function>"')
            names.append(f"c{i}")
        head = f'start: "{cls.OPEN}\\n" ({" | ".join(names)}) "\\n{cls.CLOSE}"'
        return head + "\n" + "\n".join(rules) + "\n"
