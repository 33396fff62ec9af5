"""One engine for real models: `dualpath serve --model-dir` runs HF Llama / Qwen2 / Qwen3 checkpoints
through the DualPath runtime (PE and DE processes, the persistent store), and its greedy tokens
equal transformers' `generate` on the same checkpoint, on the first turn and on a second turn
whose prefix is read back from the store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.serve.conftest import ServerProc  # noqa: E402

from dualpath.frontend.checkpoint import write_tiny_checkpoint  # noqa: E402
from dualpath.frontend.tokenizer import HFTokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BLOCK = 16
NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProc, Path]]:
    root = tmp_path_factory.mktemp(request.param)
    ckpt = write_tiny_checkpoint(root / f"tiny-{request.param}", arch=request.param)
    server = ServerProc(
        [
            "--model-dir",
            str(ckpt),
            "--block-tokens",
            str(BLOCK),
            "--kv-root",
            str(root / "kv"),
            "--system",
            "dualpath",
        ]
    )
    try:
        yield server, ckpt
    finally:
        assert server.stop() == 0


def _generate(ckpt: Path, prompt: list[int], n: int) -> list[int]:
    torch.set_num_threads(1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # exactly n tokens
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _text(tok: HFTokenizer, ids: list[int]) -> str:
    """What the server answers for ``ids``: their decode (an incomplete UTF-8 tail too, as
    U+FFFD: ``TextStream.finish``)."""
    return tok.decode(ids)


def _completion(server: ServerProc, ckpt: Path, prompt: list[int]) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=90)
    stream = client.completions.create(
        model=ckpt.name,
        prompt=prompt,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == NEW
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return "".join(c.choices[0].text for c in chunks if c.choices), int(cached or 0)


def test_greedy_tokens_equal_transformers_generate_on_both_turns(
    served: tuple[ServerProc, Path],
) -> None:
    server, ckpt = served
    tok = HFTokenizer.from_dir(ckpt)
    first = tok.encode(tok.render_chat([{"role": "user", "content": "Run the tests. " * 6}]))
    expected = _generate(ckpt, first, NEW)
    text, cached = _completion(server, ckpt, first)
    assert cached == 0
    assert text == _text(tok, expected)
    # the agent's next turn resends the conversation: its Full Blocks come from the store
    second = [*first, *expected, *tok.encode("Observation: 3 passed. Now fix the bug.")]
    text2, cached2 = _completion(server, ckpt, second)
    assert cached2 == (len(first) + NEW - 1) // BLOCK * BLOCK > 0
    assert text2 == _text(tok, _generate(ckpt, second, NEW))
    # the bytes went through the runtime's paths: a storage read (PE or DE side), PE → DE
    # transfer of the prompt KV, persist of the new blocks (stats reach /metrics every 0.5 s)
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        read = server.metric(
            'dualpath:kv_bytes_total{path="storage_to_pe_buffer"}'
        ) + server.metric('dualpath:kv_bytes_total{path="storage_to_de_buffer"}')
        if read > 0 and server.metric('dualpath:kv_bytes_total{path="de_to_storage"}') > 0:
            break
        time.sleep(0.2)
    assert read > 0
    assert server.metric('dualpath:kv_bytes_total{path="pe_hbm_to_de_buffer"}') > 0
    assert server.metric('dualpath:kv_bytes_total{path="de_to_storage"}') > 0
