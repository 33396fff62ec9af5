"""The runtime on a local multi-node Ray cluster: one raylet per emulated node, loopback only.

Each raylet offers its node's marker resource, so the PE and the DE (and each node's storage
actor) land on different Ray nodes and every KV byte between them crosses nodes over TCP.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.procs import two_raylets

from dualpath.runtime.options import FaultPlan, RuntimeOptions
from dualpath.runtime.ray_launcher import LOCAL_TEMP_PARENT, LOCAL_TEMP_PREFIX, ray_session
from dualpath.runtime.session import Runtime
from dualpath.workload.scripts import AgentScript, agent_scripts, small_trajectories

from .conftest import reference_outputs, small_config

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.slow, pytest.mark.runtime]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two raylets on this host (``tests.procs.two_raylets``): node 0 (head) and node 1, each
    with its marker resource, in a private temp dir."""
    with two_raylets() as (c, _):
        yield c


def _agents(num_agents: int, num_turns: int, seed: int) -> list[AgentScript]:
    cfg = small_config()
    wl = replace(cfg.workload, num_agents=num_agents, seed=seed)
    trajs = small_trajectories(wl, 64, num_turns=num_turns, token_scale=0.15, max_gen_tokens=4)
    return agent_scripts(trajs, cfg.model.vocab_size, seed)


def _nodes_of(rt: Runtime) -> dict[str, str]:
    """Ray node id of every actor, by process name."""
    out = {}
    for name, actor in rt.launcher.procs.items():
        out[name] = ray.get(
            actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
        )
    return out


@pytest.mark.timeout(120)
def test_a_local_instance_is_new_private_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench --runtime ray` without ``--ray-address``: a new local instance whose temp dir
    (sockets, logs) is its own, short, and removed at shutdown; it reads no address an
    earlier run or the environment names and needs no ``/tmp/ray`` (here: an empty default)."""
    assert not ray.is_initialized()  # runs before this module's cluster starts
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's default temp dir: absent
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{s.getsockname()[1]}")
    with ray_session("", 2) as session:
        temp = Path(session._private.worker._global_node.get_temp_dir_path())
        have = session.cluster_resources()
        assert temp.is_dir()
    assert temp.parent == Path(LOCAL_TEMP_PARENT) and temp.name.startswith(LOCAL_TEMP_PREFIX)
    assert have["dualpath_node0"] == have["dualpath_node1"] == 1.0  # one node offers both
    assert not ray.is_initialized() and not temp.exists()  # shut down, its dir removed
    assert not list(tmp_path.iterdir())  # nothing written to Ray's default temp dir


@pytest.mark.timeout(150)
def test_ray_run_crosses_nodes_survives_an_engine_death_and_gives_recompute_tokens(
    cluster: Any, tmp_path: Path
) -> None:
    """One run (each start costs a process per actor): both read paths across the two nodes,
    the two PEs' hidden-state exchange between their own regions, and the DE actor dying at
    its 3rd work message replaced on its node."""
    cfg = small_config(gpus_per_node=2)  # PEs 0, 1 (one group) on node 0; DEs 2, 3 on node 1
    agents = _agents(2, 3, seed=2)
    want = reference_outputs(cfg, agents)
    faults = FaultPlan(crash_engine=3, crash_at_message=3)
    opts = RuntimeOptions(
        system="dpl", kv_root=str(tmp_path), transport="tcp", runtime="ray", faults=faults
    )
    with Runtime(cfg, opts) as rt:
        launcher = rt.launcher
        first_de = launcher.procs["de3@node1"]
        before = _nodes_of(rt)
        exchange = {e: launcher.exchange_peer(f"pe{e}@node0") for e in (0, 1)}
        result = rt.run(agents)
        after = _nodes_of(rt)
        respawned = launcher.procs["de3@node1"] is not first_de
        regions, specs = launcher.env.regions, launcher.env.buffers
        sent = [
            ray.get(
                launcher.procs[f"pe{e}@node0"].__ray_call__.remote(
                    lambda a: a.engine.exchange.stats.bytes_sent
                )
            )
            for e in (0, 1)
        ]
    assert before["pe0@node0"] == before["storage@node0"] != before["de3@node1"]
    assert before["de3@node1"] == before["storage@node1"] == after["de3@node1"]  # same node
    assert all(r.endpoint.startswith("tcp://127.0.0.1:") for r in regions)  # loopback only
    # each PE announced a region of its own on its collectives' transport; both exchanged
    assert all(p is not None and p[0].endpoint.startswith("tcp://") for p in exchange.values())
    assert exchange[0][0].endpoint != exchange[1][0].endpoint and min(sent) > 0
    assert respawned and result.requeued >= 1  # the dead DE's requests ran again
    assert result.outputs == want  # every token equals the recompute reference
    assert len(result.records) == 6  # every turn finished exactly once
    sides = {r.read_side for r in result.records if r.hit_tokens}
    assert sides == {"pe", "de"}  # both paths; DE reads reach the PE from the other node
    assert (
        result.bytes_by_path["storage_to_de_buffer"] > 0
        and result.bytes_by_path["pe_hbm_to_de_buffer"] > 0
    )
    assert not launcher.procs  # closed: every actor killed
    assert not [s.name for s in specs if Path("/dev/shm", s.name).exists()]  # buffers unlinked
