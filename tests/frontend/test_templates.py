"""Chat templates through transformers' renderer (``frontend/tokenizer.py``, ``frontend/render.py``):
its jinja extensions and globals, ``tools`` / ``documents`` / ``add_generation_prompt`` /
``chat_template_kwargs``, and template errors that name the field at fault."""

from __future__ import annotations

from typing import Any

import pytest

from dualpath.frontend.chat import plan_chat
from dualpath.frontend.schema import ApiError, ChatRequest
from dualpath.frontend.tokenizer import ChatInputs, TinyTokenizer, render_template

pytest.importorskip("transformers")

# Qwen3-style: tools listed with their descriptions, a date, <think> opened unless disabled
QWEN3 = (
    "{%- if tools %}{{ 'Tools:' }}{% for t in tools %}{{ ' ' + t.function.name + ': ' + "
    "t.function.description }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{{- 'Today: ' + strftime_now('%Y') + '\\n' }}"
    "{%- for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}{% endif %}"
    "{% if loop.index > 8 %}{% break %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{%- if documents %}{% for d in documents %}{{ '[doc] ' + d.title + ': ' + d.text + ' (' + d.source + ')\\n' }}"
    "{% endfor %}{% endif %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


class _Tok(TinyTokenizer):
    """The tiny tokenizer with the template above."""

    @property
    def chat_template(self) -> str:
        return QWEN3

    def render_chat(self, messages: Any, inputs: ChatInputs | None = None) -> str:
        return render_template(QWEN3, messages, inputs)


ASK = [{"role": "user", "content": "hi"}]


def _plan(**body: Any) -> Any:
    return plan_chat(
        ChatRequest.model_validate({"messages": ASK, **body}),
        _Tok(),
        "hermes",
        True,
        reasoning="qwen3",
    )


def test_the_renderer_has_transformers_extensions_and_globals() -> None:
    text = render_template(QWEN3, ASK * 10)
    assert text.count("<|im_start|>user") == 8  # {% break %}: loopcontrols
    assert "Today: 20" in text  # strftime_now
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    without = render_template(QWEN3, ASK, ChatInputs(add_generation_prompt=False))
    assert not without.endswith("<think>\n")


def test_chat_template_kwargs_documents_and_tools_reach_the_template() -> None:
    plan = _plan(chat_template_kwargs={"enable_thinking": False})
    assert not plan.reasoning_opened
    assert _plan().reasoning_opened  # the prompt opened <think>: the reply starts inside
    tok = _Tok()
    docs = _plan(documents=[{"title": "A", "text": "alpha", "source": "s"}])
    assert "[doc] A: alpha (s)" in tok.decode(docs.prompt)
    tools = [{"type": "function", "function": {"name": "ls"}}]  # no description: still renders
    assert "Tools: ls: " in tok.decode(_plan(tools=tools).prompt)


def test_template_errors_name_the_field() -> None:
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ApiError, match="messages: the chat template failed: a system message"):
        plan_chat(ChatRequest.model_validate({"messages": bad}), _Tok(), "hermes", True)
    with pytest.raises(ApiError) as err:
        _plan(documents=[{"text": "no source"}])
    assert err.value.param == "documents"
    with pytest.raises(ApiError, match=r"chat_template_kwargs\.messages: set by the server"):
        _plan(chat_template_kwargs={"messages": []})
