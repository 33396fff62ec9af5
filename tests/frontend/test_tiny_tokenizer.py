"""The built-in tiny model's tokenizer: a visible text for every id, exact ASCII round trips,
specials in text, the one replacement id, vocabulary-size bounds, word-piece compression."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.frontend.tiny_vocab import (
    CHARS,
    MIN_VOCAB_SIZE,
    REPLACEMENT,
    SPECIALS,
    WHITESPACE_TOKENS,
    tiny_vocabulary,
)
from dualpath.frontend.tokenizer import TinyTokenizer

TOK = TinyTokenizer()
ENGLISH = (
    "You are a careful coding agent. Think step by step and call one tool per turn. "
    "List the repository layout, then open the README file and summarise the build steps.\n"
    "def main() -> None:\n    return print(self.value)\n"
)


def test_every_id_but_the_specials_decodes_to_visible_text() -> None:
    assert TOK.vocab_size == len(TOK._text) == 1024
    assert TOK.eos_token_ids == (2, 0)  # <|im_end|> and <|endoftext|>, as Qwen's
    assert TOK.decode([0, 1, 2]) == ""  # specials are not text (skip_special_tokens)
    assert TOK.decode([0, 1, 2], skip_special_tokens=False) == "".join(SPECIALS)
    whitespace = []
    for i in range(TOK.vocab_size):
        if i < len(SPECIALS):
            continue
        text = TOK.decode([i])
        assert text and text.isascii() and all(c in CHARS for c in text), (i, text)
        if not text.strip():
            whitespace.append(text)
    assert sorted(whitespace) == sorted(WHITESPACE_TOKENS)


def test_vocabulary_is_fixed_and_has_no_duplicates() -> None:
    full = tiny_vocabulary()
    assert full == tiny_vocabulary()  # deterministic
    assert len(set(full)) == len(full)
    assert full[:3] == SPECIALS and "".join(full[3:MIN_VOCAB_SIZE]) == CHARS
    assert all(len(p) > 1 for p in full[MIN_VOCAB_SIZE:])
    assert TinyTokenizer(len(full)).decode([len(full) - 1]) == full[-1]
    assert {" the", " and", "ing", "def ", "return", "()", "    "} <= set(full[:1024])


@given(st.lists(st.integers(3, 1023), min_size=1, max_size=40))
def test_a_reply_is_blank_only_when_every_id_is_whitespace(ids: list[int]) -> None:
    text = TOK.decode(ids)
    blank = all(TOK.decode([i]) in WHITESPACE_TOKENS for i in ids)
    assert bool(text.strip()) == (not blank)


@given(st.text(alphabet=string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")))
def test_ascii_round_trips_exactly(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == text


@given(st.lists(st.sampled_from(["<|im_start|>", "<|endoftext|>", "the", " ", "\n", "<|", "|>"])))
def test_round_trip_through_pieces_and_specials(parts: list[str]) -> None:
    text = "".join(parts)
    assert TOK.decode(TOK.encode(text), skip_special_tokens=False) == text


def test_specials_in_text_are_one_token_each() -> None:
    text = TOK.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = TOK.encode(text)
    assert ids.count(1) == 2 and ids.count(2) == 1 and ids[0] == 1
    assert TOK.encode("<|endoftext|>") == [0]
    assert TOK.decode(ids, skip_special_tokens=False) == text
    assert TOK.decode(ids) == "user\nhi\nassistant\n"  # specials skipped
    assert TOK.encode("<|im_end") == TOK.encode("<|") + TOK.encode("im_end")  # not a special


def test_characters_outside_ascii_become_the_replacement_id() -> None:
    q = TOK.encode(REPLACEMENT)
    assert q == [TOK.replacement_id]
    assert TOK.encode("é") == q and TOK.encode("\r") == q and TOK.encode("🙂") == q
    assert TOK.encode("naïve\r\n") == TOK.encode("na") + q + TOK.encode("ve") + q + TOK.encode("\n")
    assert TOK.decode(TOK.encode("héllo, wörld")) == "h?llo, w?rld"


@pytest.mark.parametrize("size", [0, MIN_VOCAB_SIZE - 1, len(tiny_vocabulary()) + 1])
def test_vocab_size_outside_the_bounds_is_rejected(size: int) -> None:
    with pytest.raises(ValueError, match=f"vocab_size={size}"):
        TinyTokenizer(size)


def test_smallest_vocabulary_still_round_trips() -> None:
    tok = TinyTokenizer(MIN_VOCAB_SIZE)
    ids = tok.encode(ENGLISH)
    assert len(ids) == len(ENGLISH) and tok.decode(ids) == ENGLISH


def test_decode_rejects_ids_outside_the_vocabulary() -> None:
    for bad in (-1, 1024):
        with pytest.raises(ValueError, match=f"token id {bad}"):
            TOK.decode([5, bad])


def test_english_and_code_take_fewer_tokens_than_characters() -> None:
    ids = TOK.encode(ENGLISH)
    assert TOK.decode(ids) == ENGLISH
    assert len(ids) * 2 < len(ENGLISH)  # more than two characters per token
    assert TOK.encode(" the") == [TOK._ids[" the"]]  # a whole word is one token
