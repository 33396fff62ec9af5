"""Text ↔ token ids and chat templates: a ``tokenizer.json`` tokenizer or a byte tokenizer.

``HFTokenizer`` reads a local ``tokenizer.json`` with the ``tokenizers`` library and the chat
template from ``tokenizer_config.json`` (or ``chat_template.jinja``); without one, the
documented default is ChatML (``DEFAULT_CHAT_TEMPLATE``). ``ByteTokenizer`` serves the built-in
tiny model: one id per UTF-8 byte plus three ChatML special tokens. No network.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TextTokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str: ...


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _render(template: str, messages: Sequence[dict[str, Any]], **extra: Any) -> str:
    from jinja2 import TemplateError

    try:
        return _compile(template).render(
            messages=list(messages), add_generation_prompt=True, **extra
        )
    except TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from None


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
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
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
        return cls(
            Tokenizer.from_file(str(root / "tokenizer.json")),
            template,
            _token_text(cfg.get("eos_token")),
            _token_text(cfg.get("bos_token")),
            extra_eos_ids,
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        return _render(
            self.chat_template,
            messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255; ``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>``
    258 (the EOS). For the built-in tiny model (vocabulary 1024); ChatML template."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int = 1024) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise ValueError(f"vocab_size={vocab_size} is invalid for bytes: must be >= 259")
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")
        self.eos_token_ids: tuple[int, ...] = (self._special_ids["<|im_end|>"],)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):
            if piece in self._special_ids:
                out.append(self._special_ids[piece])
            elif piece:
                out.extend(piece.encode())
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        return _render(DEFAULT_CHAT_TEMPLATE, messages)
