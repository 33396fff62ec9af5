"""The pieces of DualPath over vLLM started by hand (``dualpath sidecar``, the connector's and
the router's view of them): real side-car processes on loopback describe their nodes; the
router's deployment is built from them, and refuses what does not fit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integrations.nodes import vllm_python

from dualpath.integrations.vllm.node import call, describe, wait_ready
from dualpath.integrations.vllm.setup import ModelShape, kv_namespace
from dualpath.integrations.vllm.standalone import (
    deployment_from_sidecars,
    hbm_tokens_of,
    kv_transfer_config,
)
from dualpath.kv.weights import checkpoint_digest
from dualpath.net import free_port

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda is not installed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_tiny_checkpoint(
        out, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128
    )
    return out


@pytest.fixture()
def sidecars(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    """Two side-cars started as an operator starts them: node 0 (pe) and node 1 (de), with
    a token file that this process (the router's seat) reads too."""
    python = vllm_python()
    token = tmp_path / "sidecar-token"
    token.write_text("t0k3n-" + "5" * 40 + "\n")
    monkeypatch.delenv("DUALPATH_SIDECAR_TOKEN", raising=False)
    monkeypatch.setenv("DUALPATH_SIDECAR_TOKEN_FILE", str(token))
    procs, addresses = [], []
    for node, kind in ((0, "pe"), (1, "de")):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "sidecar",
            "--node",
            str(node),
            "--kind",
            kind,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--store",
            str(tmp_path / "kv"),
            "--model-dir",
            str(checkpoint),
            "--buffer-mib",
            "1",
            "--vllm-python",
            python,
            "--sidecar-token-file",
            str(token),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH_SIDECAR")}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
        addresses.append(f"tcp://127.0.0.1:{port}")
    try:
        for a in addresses:
            wait_ready(a, timeout_s=60)
        yield addresses
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
        banners = [p.stdout.read() if p.stdout else "" for p in procs]
    assert codes == [0, 0]
    assert "--kv-transfer-config" in banners[0] and "tcp://127.0.0.1" in banners[0]


def test_side_cars_started_by_hand_describe_one_deployment(
    sidecars: list[str], checkpoint: Path
) -> None:
    spec, facts = describe(sidecars[1])
    assert (spec.node, spec.kind, spec.control) == (1, "de", sidecars[1])
    shape = ModelShape(**facts["shape"])
    assert shape == ModelShape.from_checkpoint(checkpoint, "bfloat16")
    assert facts["weights_digest"] == checkpoint_digest(checkpoint)
    # every block header carries the deployment's namespace, derived from the same facts
    assert spec.store_namespace == kv_namespace(facts["weights_digest"], shape, 32, facts["engine"])

    dep = deployment_from_sidecars(sidecars[::-1], ["http://p:1/"], ["http://d:2"], "tiny", 640)
    assert [(n.node, n.kind) for n in dep.nodes] == [(0, "pe"), (1, "de")]
    assert [i.url for i in dep.instances] == ["http://p:1", "http://d:2"]
    assert dep.namespace("") == spec.store_namespace and dep.hbm_tokens == 640

    with pytest.raises(ValueError, match=r"need nodes 0\.\.1 of kind pe"):
        deployment_from_sidecars(sidecars, ["http://p:1", "http://p:2"], [], "tiny", 640)
    with pytest.raises(ValueError, match="need nodes"):
        deployment_from_sidecars(sidecars[:1], ["http://p:1"], ["http://d:2"], "tiny", 640)


def test_the_connector_config_names_every_side_car(sidecars: list[str]) -> None:
    cfg = json.loads(kv_transfer_config(1, sidecars))
    assert cfg["kv_connector"] == "DualPathConnector"
    assert cfg["kv_connector_extra_config"] == {"node": 1, "sidecars": sidecars}
    assert call(sidecars[0], {"op": "ping"})["pid"] > 0  # with this process's token
    for wrong in ("", "t0k3n-"):
        with pytest.raises(ValueError, match="unauthorized"):
            call(sidecars[0], {"op": "describe"}, token=wrong)


def test_hbm_tokens_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="2048",'
        'num_cpu_blocks="None"} 1.0\n'
    )
    assert hbm_tokens_of(text, 32) == 65536
    with pytest.raises(ValueError, match="--hbm-tokens"):
        hbm_tokens_of("vllm:num_requests_running 0\n", 32)
