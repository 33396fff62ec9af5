"""`dualpath serve`: bad flags and checkpoints are one line and exit code 2 (no server starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--system", "fancy"], "--system 'fancy' is invalid"),
        (["--device", "cuda"], "tiny model runs on cpu"),
        (["--dtype", "float16"], "--dtype 'float16' is invalid"),
        (["--runtime", "slurm"], "--runtime 'slurm' is invalid"),
        (["--ray-address", "127.0.0.1:1"], "--ray-address is only valid with --runtime ray"),
        (["--preset", "ds660b-2p4d"], "cannot run on the local runtime"),
        (["--hbm-tokens", "100000000"], "--hbm-tokens 100000000 is invalid"),
        (["--block-tokens", "0"], "--block-tokens 0 is invalid"),
        (["--kv-root", "/proc/no"], "--kv-root '/proc/no' is invalid"),
        (["--snic-mb-per-s", "0"], "--snic-mb-per-s 0.0 is invalid"),
        (["--port", "70000"], "--port 70000 is invalid"),
        (["--device", "tpu"], "--device 'tpu' is invalid"),
        (["--api-key", "acme="], "--api-key 'acme=' is invalid"),
        (["--threads", "-1"], "--threads -1 is invalid"),
        (["--preset", "nope"], "nope"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_bad_model_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model-dir", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["serve", "--model-dir", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["serve", "--model-dir", str(tmp_path)]) == 2
    assert "missing field 'num_attention_heads'" in capsys.readouterr().err
    full = {"model_type": "llama", "num_attention_heads": 2, "hidden_size": 8,
            "vocab_size": 10, "intermediate_size": 8, "num_hidden_layers": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(full))
    assert main(["serve", "--model-dir", str(tmp_path)]) == 2
    assert "no *.safetensors" in capsys.readouterr().err
