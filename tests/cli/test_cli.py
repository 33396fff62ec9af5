"""The CLI: planner report, JSON, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from dualpath.cli.main import main


def test_plan_default_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "ds660b-2p4d"]) == 0
    out = capsys.readouterr().out
    assert "1/7 ≤ P/D ≤ 7/2" in out
    assert "(P+D)/P = 3.00×" in out


def test_plan_two_snics_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--preset", "ds27b-1p1d", "--set", "hardware.snic_per_node=2", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["range"]["upper_binding"] == "DE DRAM"
    assert data["range"]["lower"] == pytest.approx(1 / 3)
    assert data["in_range"] is True


def test_plan_warns_outside_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--P", "1", "--D", "8"]) == 0
    captured = capsys.readouterr()
    assert "WARNING" in captured.out
    assert "outside bottleneck-free range" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--set", "cluster.num_prefill_nodes=-1"],
        ["plan", "--preset", "nope"],
        ["plan", "--set", "hardware.cnic_bytes_per_s=fast"],
        ["plan", "--config", "/nonexistent.toml"],
    ],
)
def test_user_errors_are_one_line_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dualpath: error: ")
    assert len(err.splitlines()) == 1


def test_config_dump(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--preset", "qwen32b-1p2d"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "qwen32b"


def test_cli_never_hides_a_broken_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from dualpath.cli import main as cli_main

    real = importlib.import_module

    def broken(name: str, *args: object) -> object:
        if name == "dualpath.cli.runtime_cmd":
            raise ModuleNotFoundError(
                "No module named 'dualpath.runtime.gone'", name="dualpath.runtime.gone"
            )
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match=r"dualpath\.runtime\.gone"):
        cli_main.build_parser()  # a bug in the package: shown, never "invalid choice"


def test_cli_never_hides_a_bad_name_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ImportError that is not a missing module (a name gone from one of our modules)."""
    import importlib

    from dualpath.cli import main as cli_main

    real = importlib.import_module

    def broken(name: str, *args: object) -> object:
        if name == "dualpath.cli.sim_cmd":
            raise ImportError("cannot import name 'gone' from 'dualpath.sim'", name="dualpath.sim")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError, match="cannot import name 'gone'"):
        cli_main.build_parser()
    with pytest.raises(ImportError, match="cannot import name 'gone'"):
        cli_main.main(["run", "--out", "unused"])  # the main job does not fall back either


def test_cli_names_a_missing_third_party_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    from dualpath.cli import main as cli_main

    real = importlib.import_module

    def missing(name: str, *args: object) -> object:
        if name == "dualpath.cli.runtime_cmd":
            raise ModuleNotFoundError("No module named 'tqdm'", name="tqdm")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", missing)
    assert cli_main.main(["bench", "--agents", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'tqdm'" in err and len(err.strip().splitlines()) == 1
