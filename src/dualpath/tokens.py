"""What the OpenAI front ends and the engines say to each other about tokens: ``VocabSpec``
(what builds an engine's grammar tokenizer), ``TokenLogprob`` (what a chosen token reports)
and ``grammar_key`` (what compiled grammars are cached by). Data only: no torch, no I/O."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VocabSpec:
    """What an engine needs to build the grammar library's tokenizer: a Hugging Face
    ``tokenizer.json`` (``tokenizer_json``: its path, readable on every engine's host), or
    the text of every token id (``tokens``: a byte-level vocabulary such as the tiny model's;
    ``special_ids`` are never produced by a grammar's text). ``eos_token_ids``: the ids a
    finished grammar allows (the request then ends as on any EOS)."""

    tokenizer_json: str = ""
    tokens: tuple[bytes, ...] = ()
    special_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.tokenizer_json) == bool(self.tokens):
            raise ValueError("VocabSpec: give exactly one of tokenizer_json and tokens")
        if not self.eos_token_ids:
            raise ValueError("VocabSpec.eos_token_ids is empty: a grammar could never end")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability under the model (the raw logits, before bias,
    penalties, mask and temperature, as vLLM reports by default) and the ``top`` most likely
    tokens ``(id, logprob)``, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def grammar_key(grammar: str) -> str:
    """The hash compiled grammars are cached by (on the engines and in the server)."""
    return hashlib.sha256(grammar.encode()).hexdigest()
