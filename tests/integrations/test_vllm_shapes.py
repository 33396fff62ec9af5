"""DualPath inside vLLM for the model shapes people deploy, end to end on CPU: each case a real
``dualpath serve --engine vllm`` beside a plain vLLM instance with the same vLLM flags (started
together), greedy, two turns of one agent (the second repeats the first and its answer), once
with every read on the PE side and once on the DE side.

- DeepSeek-V3 tiny (MLA + MoE; fp32: vLLM's CPU_MLA, 16-token blocks) at TP=1 and at TP=2:
  the latent is stored once per block (3 layers x 16 tokens x 576 x 4 bytes), written by one
  rank and loaded by both;
- Gemma 3 tiny (sliding-window + full layers: 4 KV cache groups under vLLM's hybrid manager),
  with its model dtype's KV and with an fp8 KV cache on the same store: the fp8 deployment
  never loads the bf16 blocks of the same prompt.

(Llama at prefill TP=2 / decode TP=1, decode TP=2 under preemption and PP=2: test_vllm_e2e.py.)
Each answer equals plain vLLM's; each turn's ``cached_tokens`` is the store's hits: on the
second pass every full block of each prompt (all written by the first), as
``/metrics``' hit count says too.
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
    from dualpath.serve.checkpoint import write_tiny_checkpoint

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

    def __init__(self, shape: Shape, checkpoint: Path, kv_root: Path, tmp: Path) -> None:
        self.model = checkpoint.name
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
    "ds-tp1": ("deepseek_v3", Shape("float32", MLA_FP32)),
    "ds-tp2": ("deepseek_v3", Shape("float32", (*MLA_FP32, "--tensor-parallel-size", "2"), "0|1")),
    "gemma-auto": ("gemma3", Shape("bfloat16", ("--kv-cache-dtype", "auto"))),
    "gemma-fp8": ("gemma3", Shape("bfloat16", ("--kv-cache-dtype", "fp8"))),
}


@pytest.fixture(scope="module")
def start(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Case]]:
    """Starts a case of ``CASES`` (its plain instance and its deployment together: more at
    once starve vLLM's start-up compilation on two cores); every case stopped at the end.
    The Gemma cases share one store."""
    root = tmp_path_factory.mktemp("cases")
    started: list[Case] = []

    def one(name: str) -> Case:
        arch, shape = CASES[name]
        kv = root / ("gemma-kv" if arch == "gemma3" else f"{name}-kv")
        started.append(Case(shape, checkpoints[arch], kv, root / name))
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


@pytest.mark.parametrize("tp", [1, 2])
def test_deepseek_v3_mla_latent_stored_once_at_tp(tp: int, start: Callable[[str], Case]) -> None:
    case = start(f"ds-tp{tp}")
    want = case.turns()
    dep = case.ready()
    _check_both_read_sides(dep, want, case.model, 16)
    sizes = {p.stat().st_size for p in Path(dep.kv_root).rglob("*.kvb")}
    # layers x block tokens x the 576-wide latent x fp32: once, not per rank
    assert sizes == {HEADER_BYTES + 3 * 16 * 576 * 4}
    for node in (0, 1):  # every rank copies; one writes the latent
        log = dep.instance_log(node)
        assert f"node {node}, rank 0.0 (pp.tp), layers [0, 1, 2] of 3" in log
        if tp == 2:
            assert "rank 0.1 (pp.tp)" in log and "writer False" in log
    case.stop()


def test_gemma3_hybrid_groups_and_an_fp8_cache_that_never_reads_bf16_blocks(
    start: Callable[[str], Case],
) -> None:
    for name in ("gemma-auto", "gemma-fp8"):  # one store: the fp8 pass finds bf16 blocks
        case = start(name)
        want = case.turns()
        dep = case.ready()
        # the fp8 pass starts on a store full of this prompt's bf16 blocks: no hit cold
        _check_both_read_sides(dep, want, case.model, 32)
        assert "4 KV cache group(s)" in dep.instance_log(0)  # 3 sliding, 1 full
        case.stop()
