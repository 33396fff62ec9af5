"""Test helpers shared by the process-level tests: a process's descendants from /proc, and a
private two-raylet Ray cluster on loopback (fresh-machine safe: its own temp dir, nothing an
earlier run left behind is needed, everything removed afterwards)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# the smallest raylet Ray accepts (its object store's floor is 75 MiB)
RAY_NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 80 * 1024 * 1024,
    "include_dashboard": False,
    "node_ip_address": "127.0.0.1",
}


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, their children, …)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        out += kids
        frontier = kids
    return out


@contextlib.contextmanager
def two_raylets() -> Iterator[tuple[Any, str]]:
    """Two raylets on this host, node 0 (head) and node 1, with the marker resources
    ``dualpath_node0`` / ``dualpath_node1``; this process joins as a driver. Yields the
    ``Cluster`` and its private temp dir (Ray's default temp dir while it runs)."""
    import pytest
    import ray
    from ray import cluster_utils

    temp = tempfile.mkdtemp(prefix="dpray-", dir="/tmp")  # short: Ray's socket paths
    ray_temp = os.path.join(temp, "ray")
    os.mkdir(ray_temp)
    args = {**RAY_NODE_ARGS, "temp_dir": ray_temp}
    with pytest.MonkeyPatch.context() as mp:
        # ``Cluster`` writes (and at shutdown deletes) the address file in Ray's default temp
        # dir, ignoring ``temp_dir``: point the default at this one, which Ray then shares
        mp.setenv("RAY_TMPDIR", temp)
        c = cluster_utils.Cluster(
            initialize_head=True, head_node_args={**args, "resources": {"dualpath_node0": 1}}
        )
        try:
            c.add_node(**args, resources={"dualpath_node1": 1})
            c.wait_for_nodes()
            # Ray rewrites a loopback address to the host's own IP; loopback only: keep it
            mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
            ray.init(address=c.address, logging_level="WARNING")
            yield c, temp
        finally:
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def shm_used_by(pids: list[int]) -> set[str]:
    """/dev/shm files the processes ``pids`` map (the host's /dev/shm is shared with other
    jobs, so only these processes' own entries are checked)."""
    used: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            used |= {line.split()[-1] for line in maps if "/dev/shm/" in line}
    return used


def named(pid: int, name: str) -> list[int]:
    """``pid``'s live descendants whose process name (``/proc/PID/comm``) is ``name`` (the
    runtime names its children: ``storage@node0``, ``pe0@node0``, ``dp-scheduler``, …)."""
    out = []
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{p}/comm").read_text().strip() == name[:15]:
                out.append(p)
    return sorted(out)
