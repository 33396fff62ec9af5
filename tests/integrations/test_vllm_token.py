"""The side-cars' shared token: where each process finds it, the files that hold it, and the
flags of the pieces started by hand (``dualpath sidecar``, ``dualpath router``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.cli.serve_cmd import _api_keys
from dualpath.integrations.vllm.token import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    admits,
    new_token_file,
    read_token_file,
    sidecar_token,
)


def test_the_token_comes_from_its_file_else_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert sidecar_token() == ""
    monkeypatch.setenv(TOKEN_ENV, " from-env \n")
    assert sidecar_token() == "from-env"
    f = new_token_file(tmp_path / "t")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    monkeypatch.setenv(TOKEN_FILE_ENV, str(f))
    assert sidecar_token() == f.read_text().strip() and len(sidecar_token()) == 64
    with pytest.raises(FileExistsError):  # never overwrites a token in use
        new_token_file(f)


def test_a_bad_token_file_is_one_line_naming_the_path_not_the_content(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"DUALPATH_SIDECAR_TOKEN_FILE=.*missing: cannot read"):
        read_token_file(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="the file is empty"):
        read_token_file(str(empty))


def test_admits_only_the_same_token() -> None:
    assert admits("", None) and admits("", "anything")
    assert admits("abc", "abc")
    for given in (None, "", "ab", "abcd", 123, ["abc"]):
        assert not admits("abc", given)


def test_api_keys_from_a_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\nalice=k1\n\nk2\n")
    assert _api_keys(["bob=k3"], [str(f)]) == {"k3": "bob", "k1": "alice", "k2": "key2"}
    f.write_text("alice=\n")
    with pytest.raises(ValueError, match=r"keys:1 is invalid"):
        _api_keys([], [str(f)])
    f.write_text("# none\n")
    with pytest.raises(ValueError, match="no key in it"):
        _api_keys([], [str(f)])
    with pytest.raises(ValueError, match="cannot read it"):
        _api_keys([], [str(tmp_path / "nope")])


def _dualpath(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = "import sys; from dualpath.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_sidecar_on_a_network_address_needs_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH_SIDECAR_TOKEN")}
    common = ["--node", "0", "--kind", "pe", "--store", str(tmp_path), "--model-dir", "x"]
    got = _dualpath("sidecar", "--host", "10.9.8.7", *common, env=env)
    assert got.returncode != 0
    assert "--host 10.9.8.7 without a side-car token" in got.stderr, got.stderr
    got = _dualpath(
        "sidecar", "--host", "10.9.8.7", "--sidecar-token-file", str(tmp_path / "no"), *common
    )
    assert got.returncode != 0 and "cannot read it" in got.stderr, got.stderr
