"""Text ↔ token ids and chat templates: a ``tokenizer.json`` tokenizer or the tiny tokenizer.

``HFTokenizer`` reads a local ``tokenizer.json`` with the ``tokenizers`` library and the chat
template from ``tokenizer_config.json`` (or ``chat_template.jinja``); without one, the
documented default is ChatML (``DEFAULT_CHAT_TEMPLATE``). ``TinyTokenizer`` serves the built-in
tiny model: a fixed ASCII word-piece vocabulary built in code, three ChatML specials. No network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dualpath.frontend.tiny_vocab import (
    CHARS,
    MIN_VOCAB_SIZE,
    REPLACEMENT,
    SPECIALS,
    tiny_vocabulary,
)
from dualpath.tokens import VocabSpec

# ChatML; with tools, the Hermes / Qwen 2.5 form (a system block listing them, calls in
# <tool_call> tags, results as <tool_response> user turns). Without tools, plain ChatML.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + "
    "'\\\", \\\"arguments\\\": ' + (call['function']['arguments'] | tojson) + "
    "'}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TextTokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], inputs: ChatInputs | None = None
    ) -> str: ...

    @property
    def chat_template(self) -> str: ...

    def vocab_spec(self) -> VocabSpec: ...


RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass(frozen=True, slots=True)
class ChatInputs:
    """What a chat template renders beyond the messages, as transformers' ``apply_chat_template``
    takes it: ``tools`` (OpenAI function tools), ``documents`` (``{"title", "text"}`` dicts),
    ``add_generation_prompt``, and ``template_kwargs`` (``chat_template_kwargs``: e.g.
    ``enable_thinking``)."""

    tools: tuple[dict[str, Any], ...] = ()
    documents: tuple[dict[str, Any], ...] = ()
    add_generation_prompt: bool = True
    template_kwargs: tuple[tuple[str, Any], ...] = ()


def render_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    inputs: ChatInputs | None = None,
    **specials: Any,
) -> str:
    """``template`` rendered by transformers' renderer (its jinja environment: sandboxed,
    ``loopcontrols``, ``raise_exception``, ``strftime_now``, an unescaped ``tojson``); a
    template error is a ValueError with the template's own words."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    inp = inputs or ChatInputs()
    try:
        result: Any = render_jinja_template(
            [list(messages)],
            tools=list(inp.tools) or None,
            documents=list(inp.documents) or None,
            chat_template=template,
            add_generation_prompt=inp.add_generation_prompt,
            **specials,
            **dict(inp.template_kwargs),
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template failed: {exc}") from None
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    return str(result[0][0])


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return None if value is None else str(value)


class HFTokenizer:
    """A ``tokenizer.json`` tokenizer; special tokens written in the text are recognised."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        eos_token: str | None,
        bos_token: str | None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.path = ""  # the tokenizer.json it was read from (the engines read it too)
        self.eos_token = eos_token
        self.bos_token = bos_token
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_token_ids = tuple(sorted({i for i in (*eos, *extra_eos_ids) if i is not None}))

    @classmethod
    def from_dir(cls, model_dir: str | Path, extra_eos_ids: Sequence[int] = ()) -> HFTokenizer:
        from tokenizers import Tokenizer

        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"--model-dir {root}: no tokenizer.json there")
        cfg: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            cfg = json.loads((root / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        tok = cls(
            Tokenizer.from_file(str(root / "tokenizer.json")),
            template,
            _token_text(cfg.get("eos_token")),
            _token_text(cfg.get("bos_token")),
            extra_eos_ids,
        )
        tok.path = str((root / "tokenizer.json").resolve())
        return tok

    @property
    def chat_template(self) -> str:
        return self._template

    def vocab_spec(self) -> VocabSpec:
        if not self.path:
            raise ValueError("this tokenizer was not read from a tokenizer.json")
        return VocabSpec(tokenizer_json=self.path, eos_token_ids=self.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[dict[str, Any]], inputs: ChatInputs | None = None
    ) -> str:
        return render_template(
            self._template,
            messages,
            inputs,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class TinyTokenizer:
    """A fixed word-piece tokenizer for the built-in tiny model: ids ``0 .. vocab_size-1``.

    Ids 0–2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (0 and 2 the EOS, as
    Qwen's generation config has them); 3–99 are
    newline, tab and the 95 printable ASCII characters; the rest are the first
    ``vocab_size - 100`` multi-character pieces of ``tiny_vocabulary()``. ``vocab_size``
    must be in ``[MIN_VOCAB_SIZE, len(tiny_vocabulary())]``.

    ``encode`` recognises the specials written in the text, maps each character outside
    printable ASCII, newline and tab (non-ASCII, ``\\r``, other controls) to the one id of
    ``"?"`` (lossy: the demo model has no byte tokens), and cuts the rest greedily, longest
    piece first. So ``decode(encode(s), skip_special_tokens=False) == s`` for any string of
    those 97 characters (and ``decode(encode(s)) == s`` for one without specials).

    ``decode`` drops the specials (``skip_special_tokens=False``: writes them literally, as
    Hugging Face tokenizers do). Every other id decodes
    to text with a visible (non-space) character, except the four ``WHITESPACE_TOKENS`` of
    ``tiny_vocab`` (space, tab, newline, four spaces): so a reply is empty after ``strip()``
    only if each of its ids is a special or one of those four.
    """

    def __init__(self, vocab_size: int = 1024) -> None:
        full = tiny_vocabulary()
        if not MIN_VOCAB_SIZE <= vocab_size <= len(full):
            raise ValueError(
                f"vocab_size={vocab_size} is invalid: must be in [{MIN_VOCAB_SIZE}, {len(full)}]"
                " (3 specials and 97 characters at least)"
            )
        self.vocab_size = vocab_size
        pieces = full[:vocab_size]
        self._pieces = tuple(pieces)
        self._ids = {p: i for i, p in enumerate(pieces)}
        self._special_ids = {s: self._ids[s] for s in SPECIALS}
        self.eos_token_ids: tuple[int, ...] = (self._ids["<|im_end|>"], self._ids["<|endoftext|>"])
        self.replacement_id = self._ids[REPLACEMENT]
        self._text = tuple(pieces)
        self._plain = tuple("" if p in SPECIALS else p for p in pieces)
        # the longest piece that starts with each character bounds the greedy search there
        self._longest: dict[str, int] = {}
        for p in pieces[len(SPECIALS) :]:
            self._longest[p[0]] = max(self._longest.get(p[0], 0), len(p))
        specials = "|".join(re.escape(s) for s in SPECIALS)
        self._split = re.compile(f"({specials}|[^\\t\\n -~])")

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for segment in self._split.split(text):  # specials and unknown characters apart
            if segment in self._special_ids:
                out.append(self._special_ids[segment])
            elif len(segment) == 1 and segment not in CHARS:
                out.append(self.replacement_id)
            elif segment:
                self._greedy(segment, out)
        return out

    def _greedy(self, text: str, out: list[int]) -> None:
        """Longest match at each position; ends because every character is a token."""
        i, ids, longest = 0, self._ids, self._longest
        while i < len(text):
            for k in range(min(longest[text[i]], len(text) - i), 0, -1):
                piece_id = ids.get(text[i : i + k])
                if piece_id is not None:
                    out.append(piece_id)
                    i += k
                    break

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is invalid: must be in [0, {self.vocab_size})")
        text = self._plain if skip_special_tokens else self._text
        return "".join(text[i] for i in ids)

    @property
    def chat_template(self) -> str:
        return DEFAULT_CHAT_TEMPLATE

    def render_chat(
        self, messages: Sequence[dict[str, Any]], inputs: ChatInputs | None = None
    ) -> str:
        return render_template(DEFAULT_CHAT_TEMPLATE, messages, inputs)

    def vocab_spec(self) -> VocabSpec:
        specials = tuple(self._special_ids.values())
        return VocabSpec(
            tokens=tuple(p.encode() for p in self._pieces),
            special_ids=specials,
            eos_token_ids=self.eos_token_ids,
        )
