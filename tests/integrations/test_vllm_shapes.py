"""DualPath inside vLLM for the model shapes people deploy, end to end on CPU: each case a real
``dualpath serve --engine vllm`` beside a plain vLLM instance with the same vLLM flags (started
together), greedy, two turns of one agent (the second repeats the first and its answer), once
with every read on the PE side and once on the DE side.

- DeepSeek-V3 tiny (MLA + MoE; fp32: vLLM's CPU_MLA, 16-token blocks), the prefill instance at
  TP=1 and the decode at TP=2: the latent is stored once per block (3 layers x 16 tokens x 576
  x 4 bytes), written by one rank, loaded by every rank, the same bytes whatever wrote it;
- Gemma 3 tiny (sliding-window + full layers: 4 KV cache groups under vLLM's hybrid manager)
  with an fp8 KV cache, on a store that already holds this prompt's blocks under the bf16
  deployment's namespace (in the fp8 byte layout: only the namespace tells them apart): the fp8
  deployment never loads them.

(Llama at prefill PP=2 / decode TP=2 and prefill TP=2 / decode PP=2: test_vllm_e2e.py.) Each
answer equals plain vLLM's; each turn's ``cached_tokens`` is the store's hits: on the second
pass every full block of each prompt (all written by the first), as ``/metrics``' hit count
says too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("openai")

from tests.integrations.deployments import Deployment, Plain, agent_turns
from tests.integrations.nodes import vllm_python

from dualpath.kv.store import HEADER_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
PROMPT = (
    "You are a helpful coding agent. Read the file, run the tests, fix the bug. "
    "The user asked for a summary of the repository layout and the failing test. "
    "def main(): print('hello world') return 0. Tool call: ls -la src/ && cat README.md. "
) * 3


@dataclass(frozen=True)
class Shape:
    dtype: str
    vllm_args: tuple[str, ...] = ()
    bind: str = "0-1"  # the plain instance's cores, one list per rank


def _checkpoint(root: Path, arch: str) -> Path:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(
        root / arch,
        arch=arch,
        num_layers=3 if arch == "deepseek_v3" else 4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: _checkpoint(root, arch) for arch in ("deepseek_v3", "gemma3")}


class Case:
    """A deployment and its plain instance, both started at once (a vLLM start here mostly
    waits, so several overlap well on two cores); ``turns()`` waits for the plain instance,
    takes its answers and stops it (its cores back), ``ready()`` waits for the deployment."""

    def __init__(
        self,
        shape: Shape,
        checkpoint: Path,
        kv_root: Path,
        tmp: Path,
        decode_args: list[str] = [],  # noqa: B006 (never changed)
    ) -> None:
        self.model = checkpoint.name
        self.checkpoint = checkpoint
        tmp.mkdir(parents=True, exist_ok=True)
        self.plain = Plain(
            vllm_python(),
            checkpoint,
            self.model,
            tmp / "plain.log",
            ["--dtype", shape.dtype, "--max-model-len", "2048", *shape.vllm_args],
            shape.bind,
        )
        self.dep = Deployment(
            checkpoint,
            kv_root,
            tmp / "logs",
            [
                "--dtype",
                shape.dtype,
                "--vllm-max-model-len",
                "2048",
                "--read-side",
                "pe",
                *[f"--vllm-arg={a}" for a in shape.vllm_args],
                *[f"--vllm-decode-arg={a}" for a in decode_args],
            ],
            {},
        )
        self.want: list[Any] | None = None

    def turns(self) -> list[Any]:
        if self.want is None:
            try:
                self.want = agent_turns(self.plain.ready().client, self.model, PROMPT)
            finally:
                self.plain.stop()
        return self.want

    def ready(self) -> Deployment:
        return self.dep.ready()

    def stop(self) -> None:
        self.plain.stop()
        code = self.dep.stop()  # (again: the same code)
        assert code == 0, f"dualpath serve exited with {code}"


# DeepSeek in fp32 (vLLM's CPU_MLA backend, 16-token blocks): in bf16 (AMX_MLA) a P/D split
# itself moves greedy answers (the decode computes the last prompt token alone, through
# MLA's absorbed path), with or without DualPath; bf16 is what bench_vllm.py runs
MLA_FP32 = ("--attention-backend", "CPU_MLA")
CASES = {
    # the plain instance at TP=1: in fp32 its answers are a TP=2 instance's too
    "deepseek": ("deepseek_v3", Shape("float32", MLA_FP32), ["--tensor-parallel-size=2"]),
    "gemma-fp8": ("gemma3", Shape("bfloat16", ("--kv-cache-dtype", "fp8")), []),
}


@pytest.fixture(scope="module")
def start(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Case]]:
    """Starts a case of ``CASES`` (its plain instance and its deployment together: more at
    once starve vLLM's start-up compilation on two cores); every case stopped at the end."""
    root = tmp_path_factory.mktemp("cases")
    started: list[Case] = []

    def one(name: str) -> Case:
        arch, shape, decode_args = CASES[name]
        started.append(
            Case(shape, checkpoints[arch], root / f"{name}-kv", root / name, decode_args)
        )
        return started[-1]

    yield one
    errors = []
    for case in started:
        try:
            case.stop()
        except AssertionError as err:  # every case stopped, whatever one of them did
            errors.append(err)
    assert not errors, errors


def _check_both_read_sides(dep: Deployment, want: list[Any], model: str, bs: int) -> None:
    """The two turns on the PE side, then again on the DE side: the plain instance's answers;
    the store's hits as ``cached_tokens``: none cold, then every full block of each prompt
    (all written by the first pass; one token is always computed)."""
    first = agent_turns(dep.client, model, PROMPT)
    assert [t for t, _, _ in first] == [t for t, _, _ in want]
    (_, _, cold), (_, p2, warm) = first
    assert cold == 0
    # the second turn hits what the first wrote, once durable (full blocks only)
    assert warm is not None and warm % bs == 0 and 0 < warm <= (p2 - 1) // bs * bs
    assert dep.metric("dualpath:kv_bytes_total", 'path="storage_to_pe_buffer"') > 0
    dep.read_side("de")
    second = agent_turns(dep.client, model, PROMPT)
    assert [t for t, _, _ in second] == [t for t, _, _ in want]
    assert [c for _, _, c in second] == [(p - 1) // bs * bs for _, p, _ in second]
    assert dep.metric("dualpath:kv_bytes_total", 'path="storage_to_de_buffer"') > 0
    cached = sum(c for _, _, c in first + second)
    assert dep.metric("dualpath:prefix_cache_hits_total") == cached


def test_deepseek_v3_mla_latent_stored_once_prefill_tp1_decode_tp2(
    start: Callable[[str], Case],
) -> None:
    case = start("deepseek")
    want = case.turns()
    dep = case.ready()
    _check_both_read_sides(dep, want, case.model, 16)
    sizes = {p.stat().st_size for p in Path(dep.kv_root).rglob("*.kvb")}
    # layers x block tokens x the 576-wide latent x fp32: once, not per rank
    assert sizes == {HEADER_BYTES + 3 * 16 * 576 * 4}
    prefill, decode = dep.instance_log(0), dep.instance_log(1)
    assert "node 0, rank 0.0 (pp.tp), layers [0, 1, 2] of 3" in prefill
    assert "rank 0.1" not in prefill
    for rank, writer in (("0.0", True), ("0.1", False)):  # both load, one writes
        line = f"node 1, rank {rank} (pp.tp), layers [0, 1, 2] of 3"
        assert line in decode and f"writer {writer}" in decode
    case.stop()


def _other_namespace_blocks(ckpt: Path, kv_root: Path, tokens: list[int]) -> int:
    """This prompt's Full Blocks written as a bf16 deployment of ``ckpt`` keys and stamps them
    (its namespace) but in the fp8 deployment's byte layout, with random bytes: only the
    namespace keeps the fp8 deployment from loading them. How many."""
    import random

    from dualpath.integrations.vllm.launch import engine_name
    from dualpath.integrations.vllm.setup import ModelShape, kv_namespace
    from dualpath.kv.store import BlockLayout, KVStore, block_keys
    from dualpath.kv.weights import checkpoint_digest

    bf16 = ModelShape.from_checkpoint(ckpt, "bfloat16", "auto")
    fp8 = ModelShape.from_checkpoint(ckpt, "bfloat16", "fp8")
    ns = kv_namespace(checkpoint_digest(ckpt), bf16, 32, engine_name(vllm_python()))
    layout = BlockLayout(fp8.num_layers, 32, fp8.row_bytes)
    store = KVStore(kv_root, layout, namespace=ns)
    rng = random.Random(0)
    keys = block_keys(tokens, 32, ns)
    for key in keys:
        store.write_block(key, rng.randbytes(layout.full_block_bytes))
    return len(keys)


def test_gemma3_hybrid_groups_with_an_fp8_cache_that_never_reads_bf16_blocks(
    start: Callable[[str], Case],
) -> None:
    import httpx

    case = start("gemma-fp8")
    plain = case.plain.ready()
    tokens = httpx.post(
        plain.url + "/tokenize", json={"model": case.model, "prompt": PROMPT}, timeout=60
    ).json()["tokens"]
    kv = Path(case.dep.kv_root)
    assert _other_namespace_blocks(case.checkpoint, kv, tokens) >= 5
    want = case.turns()
    dep = case.ready()
    _check_both_read_sides(dep, want, case.model, 32)  # cold: no hit in bf16's blocks
    assert "4 KV cache group(s)" in dep.instance_log(0)  # 3 sliding, 1 full
    case.stop()
