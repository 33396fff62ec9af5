"""Reasoning parsers (``REASONING_PARSERS``, by name, as vLLM's ``--reasoning-parser``): split a
reply's ``<think>…</think>`` from its answer, whole or as it streams, so the reasoning goes to
``reasoning_content`` (chat) or a reasoning item (Responses) and never into the content or a
tool call's arguments. Pure: no I/O.

``qwen3``: a reply is reasoning only from a ``<think>`` it opens with (or that the prompt
opened: ``enable_thinking`` templates end the generation prompt with it) to ``</think>``.
``deepseek_r1``: the reply starts inside reasoning (R1's template opens ``<think>``; the model
may write it again) until ``</think>``. A reply that ends before ``</think>`` is all reasoning.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from dualpath.frontend.tool_parsers import held_prefix

START, END = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` (the reply continues it)."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)


class ReasoningParser:
    """One reply's split: ``feed`` text, get ``(reasoning, content)`` safe to send; ``opened``:
    the prompt already opened ``<think>``."""

    name: ClassVar[str] = ""
    starts_inside: ClassVar[bool] = False

    def __init__(self, opened: bool = False) -> None:
        self._buf = ""
        self._state = "start"
        self._inside = opened or self.starts_inside  # where a reply without <think> starts

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._state == "start":  # before anything: may open with <think>
                head = self._buf.lstrip()
                if not final and len(head) < len(START) and START.startswith(head):
                    break
                if head.startswith(START):  # (R1 may write the prompt's opening tag again)
                    self._buf, self._state = head[len(START) :], "inside"
                else:
                    self._state = "inside" if self._inside else "after"
                continue
            if self._state == "inside":
                at = self._buf.find(END)
                if at < 0:
                    keep = 0 if final else held_prefix(self._buf, END)
                    reasoning.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                reasoning.append(self._buf[:at])
                self._buf, self._state = self._buf[at + len(END) :], "trim"
                continue
            if self._state == "trim":  # the newlines after </think> belong to neither
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._state = "after"
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole reply."""
        return self.feed(text, final=True)


class Qwen3(ReasoningParser):
    name = "qwen3"


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


REASONING_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType(
    {c.name: c for c in (Qwen3, DeepSeekR1)}
)


def reasoning_grammar(grammar: str, opened: bool) -> str:
    """``grammar`` (llguidance lark, its rule ``start``) with reasoning first: the rest of an
    open ``<think>`` (``opened``), else an optional ``<think>…</think>``; reasoning text has
    no ``<`` (so that only ``</think>`` ends it)."""
    body = grammar.replace("start:", "reply_body:", 1)
    think = '/[^<]*/ "</think>" /\\n{0,2}/'
    head = f"start: {think} reply_body" if opened else f'start: ("<think>" {think})? reply_body'
    return f"{head}\n{body}"
