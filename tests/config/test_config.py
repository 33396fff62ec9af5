from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.config import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    Config,
    apply_overrides,
    dump_json,
    from_dict,
    load_toml,
    preset,
)


def test_presets_of_the_paper_exist() -> None:
    for name in ("ds660b-2p4d", "ds27b-1p1d", "qwen32b-1p2d"):
        assert isinstance(preset(name), Config)
    for name in ("ds660b", "ds27b", "qwen32b", "deepseek-v3", "tiny"):
        assert name in MODEL_PRESETS
    assert preset("ds660b-2p4d").cluster.label == "2P4D"
    assert preset("qwen32b-1p2d").hardware.pe_buffer_bytes == 320e9


@pytest.mark.parametrize(
    ("model", "per_layer", "per_token"),
    [("ds660b", 656, 656 * 61), ("ds27b", 656, 656 * 30), ("qwen32b", 4096, 4096 * 64)],
)
def test_kv_bytes_match_spec_table(model: str, per_layer: int, per_token: int) -> None:
    m = MODEL_PRESETS[model]
    assert m.kv_bytes_per_token_per_layer == per_layer
    assert m.kv_bytes_per_token == per_token


def test_override_changes_one_field_and_keeps_the_rest() -> None:
    base = preset("ds27b-1p1d")
    c = apply_overrides(base, ["hardware.snic_per_node=2", "scheduler.split_reads=true"])
    assert c.hardware.snic_per_node == 2
    assert c.scheduler.split_reads is True
    assert c.model == base.model
    assert base.hardware.snic_per_node == 1  # frozen: the preset is untouched


def test_override_swaps_model_preset() -> None:
    c = apply_overrides(preset(), ["model=qwen32b"])
    assert c.model.name == "qwen32b"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("cluster.num_prefill_nodes=-1", "cluster.num_prefill_nodes=-1 is invalid"),
        ("cluster.num_prefill_nodes=1.5", "cluster.num_prefill_nodes='1.5' is invalid"),
        ("hardware.linear_mfu=1.5", "hardware.linear_mfu=1.5 is invalid: must be in (0, 1]"),
        ("scheduler.policy=fifo", "scheduler.policy='fifo' is invalid: must be one of"),
        ("model.nope=1", "unknown config key model.nope"),
        ("bogus.x=1", "unknown config section 'bogus'"),
        ("noequals", "must look like section.key=value"),
        ("model=gpt5", "model.preset='gpt5' is invalid"),
        ("workload.mal=100k", "workload.mal='100k' is invalid"),
        ("cluster.prefill_ep_nodes=3", "must be a divisor of cluster.num_prefill_nodes (2)"),
        ("cluster.decode_ep_nodes=-2", "cluster.decode_ep_nodes=-2 is invalid"),
        ("scheduler.read_tie_break=dice", "scheduler.read_tie_break='dice' is invalid"),
    ],
)
def test_bad_values_name_the_field(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        apply_overrides(preset(), [override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="ds660b-2p4d"):
        preset("nope")


def test_toml_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'preset = "qwen32b-1p2d"\n[cluster]\nnum_decode_nodes = 3\n[hardware]\ndram_bytes_per_s = 4e11\n'
    )
    c = load_toml(path)
    assert c.model.name == "qwen32b"
    assert c.cluster.num_decode_nodes == 3
    assert c.hardware.dram_bytes_per_s == 4e11
    again = from_dict(json.loads(dump_json(c)) | {"preset": "qwen32b-1p2d"})
    assert dump_json(again) == dump_json(c)


def test_bad_toml_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[cluster\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(ValueError, match="cannot be read"):
        load_toml(tmp_path / "missing.toml")


def test_dump_is_stable_and_complete() -> None:
    for name, c in CLUSTER_PRESETS.items():
        data = json.loads(dump_json(c))
        assert set(data) >= {"hardware", "model", "cluster", "scheduler", "workload"}, name
        assert dump_json(c) == dump_json(preset(name))
