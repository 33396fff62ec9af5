"""`dualpath serve`: bad flags, checkpoints and a missing transport library are one line and exit
code 2 (no server starts); `--metrics-open` reaches the API's options."""

from __future__ import annotations

import json
import multiprocessing.process
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dualpath.cli.main import main
from dualpath.frontend.api import ApiOptions


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
    full = {
        "model_type": "llama",
        "num_attention_heads": 2,
        "hidden_size": 8,
        "vocab_size": 10,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(full))
    assert main(["serve", "--model-dir", str(tmp_path)]) == 2
    assert "no *.safetensors" in capsys.readouterr().err


def _without_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imports of the Mooncake library fail, as where it is not installed; starting a process
    or touching the KV root (what follows the transport check) fails the test."""
    for name in ("mooncake", "mooncake.engine"):
        monkeypatch.setitem(sys.modules, name, None)

    def started(*_: object) -> None:
        raise AssertionError("got past the transport check")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)
    monkeypatch.setattr("dualpath.cli.runtime_cmd.check_kv_root", started)


def test_missing_mooncake_is_one_line_and_starts_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _without_mooncake(monkeypatch)
    assert main(["serve", "--transport", "mooncake", "--kv-root", str(tmp_path / "kv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dualpath: error: --transport mooncake needs the Mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in err and "'mooncake' extra" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("metrics_open", [False, True])
def test_metrics_open_reaches_the_api(
    metrics_open: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import uvicorn

    from dualpath.serve import server

    seen: list[ApiOptions] = []

    def app(_backend: object, options: ApiOptions) -> object:
        seen.append(options)
        return object()

    from dualpath.frontend.tokenizer import TinyTokenizer

    stub = SimpleNamespace(model_name="stub", tokenizer=TinyTokenizer())
    monkeypatch.setattr(server, "build_backend", lambda *_: stub)
    monkeypatch.setattr(server, "create_app", app)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)  # no socket, no loop
    argv = ["serve", "--api-key", "sk-x", "--kv-root", str(tmp_path)]
    assert main(argv + ["--metrics-open"] * metrics_open) == 0
    assert [(o.metrics_open, o.api_keys) for o in seen] == [(metrics_open, {"sk-x": "key0"})]
    assert seen[0].tool_format == "hermes"  # auto: the default template's <tool_call> form


def test_help_documents_metrics_open(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--metrics-open" in capsys.readouterr().out
