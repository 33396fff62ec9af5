"""`dualpath cluster ray`: the `ray start` command lines over a cluster's namespaces (pure, no
Ray started; docs/deploy.md records the full run across the namespaces)."""

from __future__ import annotations

import json

import pytest

from dualpath.deploy import ray_cluster
from dualpath.deploy.cluster import ClusterSpec, ClusterState
from dualpath.deploy.ray_cluster import RayCluster, ray_commands


def _state(preset: str = "tiny-1p1d", name: str = "rt") -> ClusterState:
    return ClusterState(ClusterSpec.from_preset(preset, name=name, subnet="10.150"), 0.0)


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_head_in_the_root_namespace_on_the_head_cnic_without_resources() -> None:
    head = ray_commands(_state(), 6380, "/run/x/rt-ray/tmp")[0]
    assert head[:3] == ["ray", "start", "--head"]  # no `ip netns exec`: the root namespace
    assert _opt(head, "--node-ip-address") == "10.150.1.1"
    assert _opt(head, "--port") == "6380"
    assert _opt(head, "--num-cpus") == "0"
    assert json.loads(_opt(head, "--resources")) == {}
    assert _opt(head, "--include-dashboard") == "false"
    assert _opt(head, "--temp-dir") == "/run/x/rt-ray/tmp/head"
    assert "--block" in head  # one process group per `ray start`, stopped by group


def test_one_raylet_per_compute_node_in_its_namespace_on_its_cnic() -> None:
    state = _state()
    cmds = ray_commands(state, 6380, "/t", ray="/venv/bin/ray")
    assert len(cmds) == 3  # head, p0, d0; the storage host runs no raylet
    for cmd, node, node_id in zip(cmds[1:], ("p0", "d0"), (0, 1), strict=True):
        assert cmd[:6] == ["ip", "netns", "exec", f"dp-rt-{node}", "/venv/bin/ray", "start"]
        assert _opt(cmd, "--address") == "10.150.1.1:6380"
        assert _opt(cmd, "--node-ip-address") == state.spec.node(node).cnic_addr
        assert json.loads(_opt(cmd, "--resources")) == {f"dualpath_node{node_id}": 1}
        assert _opt(cmd, "--temp-dir") == f"/t/node{node_id}"  # never shared with another Ray
        assert "--block" in cmd


@pytest.mark.parametrize("preset", ["tiny-1p1d", "ds660b-2p4d", "ds27b-2p1d"])
def test_node_ids_prefill_first_then_decode(preset: str) -> None:
    state = _state(preset)
    spec = state.spec
    got = {
        _opt(c, "--node-ip-address"): json.loads(_opt(c, "--resources"))
        for c in ray_commands(state, 6379, "/t")[1:]
    }
    prefill = [n for n in spec.nodes if n.kind == "prefill"]
    decode = [n for n in spec.nodes if n.kind == "decode"]
    want = {n.cnic_addr: {f"dualpath_node{i}": 1} for i, n in enumerate(prefill + decode)}
    assert got == want


def test_bench_command_names_the_address() -> None:
    rc = RayCluster("rt", "10.150.1.1:6379", "/t", (1, 2, 3))
    cmd = ray_cluster.bench_command(rc, kv_root="/kv")
    assert "--runtime ray --ray-address 10.150.1.1:6379" in cmd
    assert "--kv-root /kv" in cmd
