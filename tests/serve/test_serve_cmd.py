"""`dualpath serve`: bad flags and checkpoints are one line and exit code 2 (no server starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.cli.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "ray"], "--backend 'ray' is invalid"),
        (["--backend", "runtime", "--system", "fancy"], "--system 'fancy' is invalid"),
        (["--backend", "runtime", "--model-dir", "x"], "built-in model"),
        (["--backend", "runtime", "--device", "cuda"], "cpu only"),
        (["--backend", "runtime", "--api-key", "a=k1", "--api-key", "b=k2"], "one tenant"),
        (["--backend", "runtime", "--preset", "ds660b-2p4d"], "cannot run on the local runtime"),
        (["--backend", "runtime", "--kv-root", "/proc/no"], "--kv-root '/proc/no' is invalid"),
        (["--snic-mb-per-s", "0"], "--snic-mb-per-s 0.0 is invalid"),
        (["--port", "70000"], "--port 70000 is invalid"),
        (["--device", "tpu"], "--device 'tpu' is invalid"),
        (["--api-key", "acme="], "--api-key 'acme=' is invalid"),
        (["--max-batch-seqs", "0"], "max_batch_seqs=0 is invalid"),
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
    assert "no *.safetensors" in capsys.readouterr().err
