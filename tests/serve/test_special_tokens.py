"""Special tokens over real HTTP with the official client: an EOS id (the tiny model's
``<|endoftext|>`` among them) ends a reply unless ``ignore_eos``; special tokens never reach
the text unless the request asks for them (``skip_special_tokens: false``, vLLM's field)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tests.serve.conftest import ServerProc

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ENDOFTEXT, IM_START = 0, 1  # the tiny vocabulary's first ids


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = ServerProc(["--kv-root", str(tmp_path_factory.mktemp("kv")), "--hbm-tokens", "4096"])
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def _complete(server: ServerProc, stream: bool, **extra: Any) -> tuple[str, str | None, list[int]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
    body = {"return_token_ids": True, **extra.pop("extra_body", {})}
    args = dict(
        model="dualpath-tiny",
        prompt="tell me",
        max_tokens=6,
        temperature=0,
        extra_body=body,
        **extra,
    )
    if not stream:
        choice = client.completions.create(**args).choices[0]
        return choice.text, choice.finish_reason, list(choice.model_extra["token_ids"])  # type: ignore[index]
    text, finish, ids = "", None, []
    for chunk in client.completions.create(stream=True, **args):
        c = chunk.choices[0]
        text += c.text
        finish = c.finish_reason or finish
        ids += (c.model_extra or {}).get("token_ids") or []
    return text, finish, ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_endoftext_ends_the_reply(server: ServerProc, stream: bool) -> None:
    # the model is pushed to <|endoftext|> first: the reply ends there, with no text
    text, finish, ids = _complete(server, stream, logit_bias={str(ENDOFTEXT): 100})
    assert (text, finish) == ("", "stop") and ids in ([], [ENDOFTEXT])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_special_tokens_stay_out_of_the_text(server: ServerProc, stream: bool) -> None:
    bias = {"logit_bias": {str(ENDOFTEXT): 100}, "extra_body": {"ignore_eos": True}}
    text, finish, ids = _complete(server, stream, **bias)
    assert ids == [ENDOFTEXT] * 6 and finish == "length"
    assert text == ""  # skipped, as vLLM's default
    asked = {
        "logit_bias": {str(IM_START): 100},
        "extra_body": {"ignore_eos": True, "skip_special_tokens": False},
    }
    text, _, ids = _complete(server, stream, **asked)
    assert ids == [IM_START] * 6 and text == "<|im_start|>" * 6
