"""`dualpath bench --runtime ray`: bad input is one line and exit code 2, before Ray starts."""

from __future__ import annotations

import socket
import sys

import pytest

from dualpath.cli.main import main
from dualpath.runtime.options import RuntimeOptions

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(60)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_runtime_ray_without_ray_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["bench", "--runtime", "ray", "--agents", "1", "--turns", "1"]) == 2
    assert "pip install 'dualpath[ray]'" in _one_line(capsys)


def test_bad_ray_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "--runtime", "ray", "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert f"--ray-address '127.0.0.1:{port}' is unreachable" in _one_line(capsys)
    assert main(["bench", "--runtime", "ray", "--ray-address", "head-node"]) == 2
    assert "expected HOST:PORT" in _one_line(capsys)
    assert main(["bench", "--runtime", "ray", "--ray-address", "ray://head:10001"]) == 2
    assert "ray:// addresses are not supported" in _one_line(capsys)
    assert main(["bench", "--ray-address", "127.0.0.1:6379"]) == 2
    assert "only valid with --runtime ray" in _one_line(capsys)
    assert main(["bench", "--runtime", "ray", "--transport", "shm"]) == 2
    assert "shared memory cannot cross nodes" in _one_line(capsys)
    assert main(["bench", "--runtime", "k8s"]) == 2
    assert "must be 'local' or 'ray'" in _one_line(capsys)


def test_runtime_options_reject_what_ray_cannot_run() -> None:
    with pytest.raises(ValueError, match="runtime='k8s' is invalid"):
        RuntimeOptions(runtime="k8s")
    with pytest.raises(ValueError, match="transport='shm' is invalid with runtime='ray'"):
        RuntimeOptions(runtime="ray")
    assert RuntimeOptions(runtime="ray", transport="tcp").runtime == "ray"
