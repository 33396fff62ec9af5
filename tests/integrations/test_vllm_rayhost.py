"""The pieces of the vLLM deployment's Ray placement that need no Ray: a node's host (the
actor's body, run here in-process), a process whose node is lost, and the seats of nodes
placed on machines Ray chose. The whole path, over Ray across network namespaces, is
``test_vllm_e2e.py::test_across_cluster_nodes_over_ray_…``."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dualpath.integrations.vllm.launch import in_namespace, ray_seats
from dualpath.integrations.vllm.rayhost import DEAD, NodeHost, NodeLost, NodeSlow, RayProc
from dualpath.integrations.vllm.setup import INSTANCE_PORT, SIDECAR_PORT, VllmOptions


def test_a_node_host_starts_watches_and_kills_a_process_group(tmp_path: Path) -> None:
    host = NodeHost()
    log = tmp_path / "logs" / "p.log"  # its folder is made on the node
    code = "import time, subprocess, sys; print('up', flush=True); time.sleep(60)"
    pid = host.start("p", [sys.executable, "-c", code], None, str(log))
    assert pid > 0 and host.poll("p") is None
    assert host.wait("p", 0.1) is None  # still running
    for _ in range(100):
        if "up" in host.read_text(str(log)):
            break
        host.wait("p", 0.05)
    assert "up" in host.read_text(str(log))
    host.kill_group("p", signal.SIGKILL)
    assert host.poll("p") == -signal.SIGKILL
    assert host.read_text(str(tmp_path / "none")) == ""
    # a restart under the same name appends to the same log
    host.start("p", [sys.executable, "-c", "print('again')"], None, str(log))
    assert host.wait("p", 30) == 0
    assert host.read_text(str(log)).splitlines()[-1] == "again"


class _Answering:
    """Answers as a host actor that is gone (``lost``), or one that is only slow."""

    def __init__(self, lost: bool) -> None:
        self.lost = lost

    def ask_actor(self, actor: Any, node: int, method: str, *a: Any, timeout_s: float = 0) -> Any:
        raise (NodeLost if self.lost else NodeSlow)(f"node {node}'s Ray host")


def test_a_process_whose_host_is_gone_reads_as_killed_and_a_slow_one_as_running() -> None:
    proc = RayProc(_Answering(lost=True), 3, None, "vllm3-de", 1234)  # type: ignore[arg-type]
    assert proc.poll() == DEAD and proc.wait(1) == DEAD and proc.returncode == DEAD
    proc.kill_group(signal.SIGKILL)  # nothing to signal: no error
    assert proc.segments() == set() and proc.unlink_unmapped({"psm_x"}) == []
    slow = RayProc(_Answering(lost=False), 3, None, "vllm3-de", 1234)  # type: ignore[arg-type]
    assert slow.poll() is None and slow.returncode is None  # asked again at the next look
    with pytest.raises(subprocess.TimeoutExpired):
        slow.wait(0.1)


def test_a_host_made_anew_reads_processes_it_never_started_as_exited() -> None:
    host = NodeHost()
    assert host.poll("sidecar1") == DEAD and host.wait("sidecar1", 1) == DEAD
    host.kill_group("sidecar1", signal.SIGKILL)
    assert host.segments("sidecar1") == []


def test_a_host_prepares_the_run_folder_and_token_on_its_machine(tmp_path: Path) -> None:
    host = NodeHost()
    run = tmp_path / "far" / "run"
    host.prepare(str(run), str(run / "sidecar.token"), "s3cret")
    token = run / "sidecar.token"
    assert token.read_text() == "s3cret\n" and stat.S_IMODE(token.stat().st_mode) == 0o600
    host.prepare(str(run), str(token), "other")  # the driver's own (one host): kept as is
    assert token.read_text() == "s3cret\n"
    host.cleanup()
    assert not run.exists()


class _Placer:
    def __init__(self, where: dict[int, str]) -> None:
        self.where = where
        self.ray = SimpleNamespace(util=SimpleNamespace(get_node_ip_address=lambda: "10.0.0.1"))

    def address(self, node: int) -> str:
        return self.where[node]


def test_nodes_placed_by_ray_get_their_machines_address_and_ports_of_their_own(
    tmp_path: Path,
) -> None:
    opts = VllmOptions(model_dir=str(tmp_path), num_prefill=1, num_decode=2)
    seats = ray_seats(opts, _Placer({0: "10.0.0.5", 1: "10.0.0.6", 2: "10.0.0.6"}))
    assert [(s.cnic, s.snic) for s in seats[:3]] == [
        ("10.0.0.5", "10.0.0.5"),
        ("10.0.0.6", "10.0.0.6"),
        ("10.0.0.6", "10.0.0.6"),
    ]
    # two nodes on one machine: neither port collides
    assert [s.port for s in seats[:3]] == [INSTANCE_PORT, INSTANCE_PORT + 1, INSTANCE_PORT + 2]
    assert [s.sidecar_port for s in seats[:3]] == [SIDECAR_PORT + n for n in range(3)]
    assert seats[-1].cnic == "10.0.0.1" and all(s.namespace == "" for s in seats)


def test_commands_enter_a_namespace_only_when_named() -> None:
    assert in_namespace("", ["x", "-y"]) == ["x", "-y"]
    assert in_namespace("dp-a-p0", ["x"]) == ["ip", "netns", "exec", "dp-a-p0", "x"]


@pytest.mark.parametrize("address", ["nohost", "ray://h:1", "127.0.0.1:1"])
def test_a_bad_ray_address_is_one_line(address: str) -> None:
    pytest.importorskip("ray")
    from dualpath.integrations.vllm.rayhost import RayPlacer

    with pytest.raises(ValueError, match="--ray-address"):
        RayPlacer(address, [0, 1])
