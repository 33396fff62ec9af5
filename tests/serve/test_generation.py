"""Sampling, incremental text with stop strings, chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dualpath.frontend.generation import TextStream  # noqa: E402
from dualpath.frontend.tokenizer import HFTokenizer, TinyTokenizer  # noqa: E402
from dualpath.runtime.sampling import sample  # noqa: E402


def test_temperature_zero_is_argmax_and_seeded_sampling_repeats() -> None:
    logits = torch.tensor([0.1, 3.0, 0.2, 2.9])
    assert sample(logits, 0.0, 1.0, torch.Generator()) == 1
    draw = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    again = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draw == again
    assert set(draw) >= {1, 3}  # both likely tokens appear


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, 1.0, 0.7, gen) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 is in; 0.8 ≥ 0.7 so token 2 is out


def test_text_stream_holds_back_partial_stop_and_cuts_at_stop() -> None:
    tok = TinyTokenizer()
    stream = TextStream(tok, stop=["END"])
    out = [stream.push(t) for t in tok.encode("abcEN")]
    assert "".join(out) == "abc"  # "EN" may start "END": held back
    assert stream.push(tok.encode("D")[0]) == ""
    assert stream.stopped
    plain = TextStream(tok, stop=["END"])
    text = "".join(plain.push(t) for t in tok.encode("xyE")) + plain.finish()
    assert text == "xyE" and not plain.stopped


class _Utf8Bytes:
    """One id per UTF-8 byte: only what ``TextStream`` reads (``decode``)."""

    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        raise NotImplementedError


def test_text_stream_waits_for_complete_utf8() -> None:
    tok = _Utf8Bytes()
    stream = TextStream(tok)
    ids = tok.encode("é!")  # two bytes then one
    assert stream.push(ids[0]) == ""
    assert stream.push(ids[1]) == "é"
    assert stream.push(ids[2]) == "!"
    cut = TextStream(tok)  # generation ends inside a character: the answer is still the decode
    assert cut.push(tok.encode("é")[0]) == ""
    assert cut.finish() == tok.decode(tok.encode("é")[:1]) == "\ufffd"
    assert cut.finish() == ""


def test_tiny_tokenizer_round_trip_and_chatml() -> None:
    tok = TinyTokenizer()
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids and tok.eos_token_ids == (2, 0)
    assert tok.decode(tok.encode("hello")) == "hello"


def test_hf_tokenizer_reads_template_and_eos(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from dualpath.frontend.checkpoint import write_tokenizer

    write_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(tmp_path)
    text = tok.render_chat([{"role": "user", "content": "Run the tests."}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert tok.eos_token_ids == (tok._tok.token_to_id("<|im_end|>"),)
    assert tok._tok.token_to_id("<|im_start|>") in ids  # specials in text are one token
    assert tok.decode(tok.encode("Run the tests.")) == "Run the tests."


def test_windowed_text_stream_equals_full_decode(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    import random

    from dualpath.frontend.checkpoint import write_tokenizer

    vocab = write_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(tmp_path)
    rng = random.Random(3)
    for _ in range(5):
        ids = [rng.randrange(vocab) for _ in range(60)]
        stream = TextStream(tok)
        text = "".join(stream.push(i) for i in ids) + stream.finish()
        assert text == tok.decode(ids)  # incomplete bytes at the end too: U+FFFD, as decoded
    words = tok.encode("fix the failing test then run make test again")
    stream = TextStream(tok)
    assert "".join(stream.push(i) for i in words) == "fix the failing test then run make test again"
