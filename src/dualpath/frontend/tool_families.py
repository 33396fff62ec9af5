"""The tool-call formats of the model families (``TOOL_PARSERS``, by name): hermes (Qwen 2.5,
Qwen 3, Hermes: ``<tool_call>{json}</tool_call>``), llama3_json (Llama 3.1+: the reply is
``{"name", "parameters"}`` objects joined by ``;``), mistral (``[TOOL_CALLS][{…}]`` or
``[TOOL_CALLS]name[ARGS]{…}``), deepseek_v3 (V3 / R1 and V3.1 call tokens) and qwen3_coder
(``<function=name><parameter=key>value</parameter></function>`` in ``<tool_call>``).
``tool_parser_for``: the family a chat template teaches. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import MappingProxyType

from dualpath.frontend.tool_parsers import (
    PENDING,
    PartialCall,
    Scan,
    ToolParser,
    held_prefix,
    json_end,
    read_json_call,
    tagged,
    valid_arguments,
)
from dualpath.frontend.tool_xml import Qwen3Coder
from dualpath.frontend.tools import Tool, json_value, one_call_schema


class Hermes(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        return tagged(text, final, self.OPEN, self.CLOSE, read_json_call)

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        call = json_value(one_call_schema(tools, "arguments"))
        return f'start: "{cls.OPEN}\\n" call "\\n{cls.CLOSE}"\ncall: {call}\n'


def _json_list(body: str, final: bool, sep: str, close: str = "") -> list[PartialCall] | None:
    """Call objects one after another, ``sep`` between them (``close`` ends the list); None
    when ``body`` is not (only) calls."""
    calls: list[PartialCall] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body) or (close and body.startswith(close, pos)):
            return calls
        end = json_end(body, pos)
        if end == pos:
            return None
        call = read_json_call(body[pos:] if end is None else body[pos:end], end is not None)
        if call is PENDING:
            return calls if not final else None
        if call is None:
            return None
        calls.append(call)
        if end is None:
            return calls if not final else None
        pos = end
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if body.startswith(sep, pos):
            pos += len(sep)
        elif pos < len(body) and not (close and body.startswith(close, pos)):
            return None


class Llama3Json(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        head = text.lstrip()
        if not head or (not final and len(head) < len(self.TAG) and self.TAG.startswith(head)):
            return Scan()
        if not head.startswith(("{", self.TAG)):
            return Scan(content=text)
        calls = _json_list(head.removeprefix(self.TAG), final, ";")
        if calls is None:
            return Scan(content=text if final else "")
        return Scan(calls=calls)

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        return f"start: call\ncall: {json_value(one_call_schema(tools, 'parameters'))}\n"


class Mistral(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.MARK)
        if at < 0:
            return Scan(content=text[: len(text) - (0 if final else held_prefix(text, self.MARK))])
        out, rest = Scan(content=text[:at]), text[at + len(self.MARK) :]
        if rest.lstrip().startswith("["):
            calls = _json_list(rest.lstrip()[1:], final, ",", "]")
        else:
            calls = self._named(rest, final)
        if calls is None:
            return Scan(content=text) if final else out
        out.calls = calls
        return out

    def _named(self, rest: str, final: bool) -> list[PartialCall] | None:
        """``name[ARGS]{…}`` calls, each after a ``[TOOL_CALLS]`` but the first."""
        calls: list[PartialCall] = []
        for part in rest.split(self.MARK):
            name, sep, args = part.partition(self.ARGS)
            if not sep:
                return None if final else calls
            start = len(args) - len(args.lstrip())
            end = json_end(args, start)
            if end is None:
                calls.append(PartialCall(name.strip(), args[start:]))
                return None if final else calls
            valid = valid_arguments(args[start:end])
            if valid is None or args[end:].strip():
                return None
            calls.append(PartialCall(name.strip(), valid, done=True))
        return calls

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        call = json_value(one_call_schema(tools, "arguments"))
        return f'start: "{cls.MARK}[" call "]"\ncall: {call}\n'


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    FENCE, FENCE_END = "```json\n", "\n```"

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.BEGIN)
        if at < 0:
            return Scan(content=text[: len(text) - (0 if final else held_prefix(text, self.BEGIN))])
        scan = tagged(text[at + len(self.BEGIN) :], final, self.CALL, self.CALL_END, self._read)
        return Scan(content=text[:at], calls=scan.calls)

    def _read(self, body: str, complete: bool) -> PartialCall | None:
        head, sep, rest = body.partition(self.SEP)
        if not sep:
            return None if complete else PENDING
        if head.strip() == "function":  # V3 / R1: function<sep>name\n```json\n{…}\n```
            name, nl, rest = rest.partition("\n")
            if not nl or not rest.startswith(self.FENCE[: len(rest)]):
                return None if complete else PENDING
            rest = rest[len(self.FENCE) :] if len(rest) >= len(self.FENCE) else ""
        else:  # V3.1: name<sep>{…}
            name = head
        end = json_end(rest, 0)
        if not complete:
            return PartialCall(name.strip(), rest if end is None else rest[:end])
        args = None if end in (None, 0) else valid_arguments(rest[:end])
        tail = rest[end or 0 :].strip()
        if args is None or tail not in ("", self.FENCE_END.strip()):
            return None
        return PartialCall(name.strip(), args, done=True)

    @classmethod
    def call_grammar(cls, tools: Sequence[Tool]) -> str:
        lines, names = [], []
        for i, t in enumerate(tools):
            names.append(f"c{i}")
            lines.append(
                f'c{i}: {json.dumps(t.name)} "\\n{cls.FENCE[:-1]}\\n" '
                f'{json_value(t.grammar_schema())} "\\n```"'
            )
        head = json.dumps(cls.BEGIN + cls.CALL + "function" + cls.SEP)
        tail = json.dumps(cls.CALL_END + cls.END)
        return f"start: {head} ({' | '.join(names)}) {tail}\n" + "\n".join(lines) + "\n"


TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType(
    {c.name: c for c in (Hermes, Llama3Json, Mistral, DeepSeekV3, Qwen3Coder)}
)


def tool_parser_for(template: str, model_type: str = "") -> str:
    """The family a chat template teaches its model (a ``TOOL_PARSERS`` name)."""
    if "<function=" in template and "<tool_call>" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if "python_tag" in template or "ipython" in template or model_type == "llama":
        return "llama3_json"
    return "hermes"
