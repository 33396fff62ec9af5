"""A Ray cluster over the namespaces of ``dualpath cluster up``: the head in the root
namespace on the head's CNIC address (no resources: it runs only the driver's pieces), one
raylet per prefill/decode node inside that node's namespace on the node's CNIC address,
offering ``dualpath_node<n>`` (prefill nodes ``0..P-1``, decode nodes ``P..``, as
``ledger/topology.py`` numbers them). Our runtime's actors then bind their KV transports to
the CNIC addresses, so the KV bytes cross the shaped CNICs.

Each ``ray start --block`` runs in its own session (process group); the group ids and the
address go to ``$DUALPATH_RUN_DIR/NAME-ray/ray.json``, so ``stop_ray`` works from another
process. Every ``ray start`` gets its own ``--temp-dir`` under that directory: it never mixes
with another Ray on the host, and ``stop_ray`` finds stragglers by that path. Never runs
``ray stop`` (it would stop every Ray on the host).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dualpath.deploy.cluster import ClusterError, ClusterState, state_path
from dualpath.deploy.ray_address import RESOURCE_PREFIX

DEFAULT_PORT = 6379
# the smallest raylet Ray accepts (its object store's floor is 75 MiB), as tests/procs.py
OBJECT_STORE_BYTES = 80 * 1024 * 1024
START_TIMEOUT_S = 120.0
STOP_WAIT_S = 10.0
# the longest temp dir given to Ray: its session's Unix sockets (``…/session_<date>_<pid>/
# sockets/plasma_store``, ~65 bytes more) must fit in a socket path's 107 bytes; a run
# directory deeper than this gets a short temp dir under /tmp instead (recorded, removed)
TEMP_DIR_MAX = 40
# Ray 2.60 turns on token auth when ~/.ray/auth_token exists, which a driver given an explicit
# address does not send; the cluster lives on private bridges, so auth is off, whatever ~ holds
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


@dataclass(frozen=True, slots=True)
class RayCluster:
    """A started Ray cluster: its GCS ``address`` (``HEAD:PORT``), temp dir and the process
    group of each ``ray start --block`` (head first)."""

    name: str
    address: str
    temp_dir: str
    pgids: tuple[int, ...]


def ray_dir(name: str) -> Path:
    """``$DUALPATH_RUN_DIR/NAME-ray``: the Ray state file, logs and temp dirs of cluster NAME."""
    return state_path(name).with_name(f"{name}-ray")


def ray_executable() -> str:
    """The ``ray`` next to this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "ray"
    return str(here) if here.exists() else "ray"


def compute_nodes(state: ClusterState) -> list[tuple[int, str, str]]:
    """``(node id, namespace, CNIC address)`` of every prefill then decode node."""
    nodes = [n for n in state.spec.nodes if n.kind != "store"]
    prefill = [n for n in nodes if n.kind == "prefill"]
    decode = [n for n in nodes if n.kind == "decode"]
    return [(i, n.namespace, n.cnic_addr) for i, n in enumerate(prefill + decode)]


def ray_commands(
    state: ClusterState, port: int, temp_dir: str, ray: str = "ray"
) -> list[list[str]]:
    """Every ``ray start`` that ``start_ray`` runs, head first (pure: no I/O)."""
    head = state.spec.head_cnic_addr
    light = ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block"]
    cmds = [
        [
            ray,
            "start",
            "--head",
            "--node-ip-address",
            head,
            "--port",
            str(port),
            "--num-cpus",
            "0",
            "--resources",
            "{}",
            "--include-dashboard",
            "false",
            "--temp-dir",
            os.path.join(temp_dir, "head"),
            *light,
        ]
    ]
    for node_id, ns, addr in compute_nodes(state):
        resources = json.dumps({f"{RESOURCE_PREFIX}{node_id}": 1})
        cmds.append(
            [
                "ip",
                "netns",
                "exec",
                ns,
                ray,
                "start",
                "--address",
                f"{head}:{port}",
                "--node-ip-address",
                addr,
                "--num-cpus",
                "1",
                "--resources",
                resources,
                "--temp-dir",
                os.path.join(temp_dir, f"node{node_id}"),
                *light,
            ]
        )
    return cmds


def _record_path(name: str) -> Path:
    return ray_dir(name) / "ray.json"


def _write(rc: RayCluster) -> None:
    path = _record_path(rc.name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rc), indent=2))
    tmp.replace(path)


def _nodes_seen(ray: str, address: str) -> set[str]:
    """The ``dualpath_node<n>`` resources that ``ray status`` shows on the cluster."""
    done = subprocess.run(
        [ray, "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **RAY_ENV},
    )
    return {w for w in done.stdout.split() if w.startswith(RESOURCE_PREFIX)}


def start_ray(
    state: ClusterState, port: int = DEFAULT_PORT, timeout_s: float = START_TIMEOUT_S
) -> RayCluster:
    """Start the head and one raylet per compute node; wait until ``ray status`` shows every
    node's resource; record the process groups. On any failure stop what was started."""
    name = state.spec.name
    if _record_path(name).exists():
        raise ClusterError(
            f"Ray is already started on cluster {name!r}: "
            f"`dualpath cluster ray --name {name} --stop` first"
        )
    base = ray_dir(name)
    base.mkdir(parents=True, exist_ok=True)
    temp_dir = str(base / "tmp")
    if len(temp_dir) > TEMP_DIR_MAX:  # Ray's Unix sockets under it would not fit in 107 bytes
        temp_dir = tempfile.mkdtemp(prefix=f"dpray-{name}-", dir="/tmp")
    ray = ray_executable()
    address = f"{state.spec.head_cnic_addr}:{port}"
    rc = RayCluster(name, address, temp_dir, ())
    _write(rc)
    try:
        for i, argv in enumerate(ray_commands(state, port, temp_dir, ray)):
            with open(base / f"start{i}.log", "wb") as log:
                proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env={**os.environ, **RAY_ENV},
                )
            rc = RayCluster(name, address, temp_dir, (*rc.pgids, proc.pid))
            _write(rc)
            if i == 0:
                _wait_port(ray, address, proc, timeout_s)
        want = {f"{RESOURCE_PREFIX}{n}" for n, _, _ in compute_nodes(state)}
        deadline = time.monotonic() + timeout_s
        while not want <= _nodes_seen(ray, address):
            if time.monotonic() > deadline:
                missing = sorted(want - _nodes_seen(ray, address))
                raise ClusterError(
                    f"Ray nodes {', '.join(missing)} did not join {address} in {timeout_s:g} s "
                    f"(logs: {base}/start*.log)"
                )
            time.sleep(1.0)
    except BaseException:
        stop_ray(name)
        raise
    return rc


def _wait_port(ray: str, address: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(
            [ray, "status", "--address", address],
            capture_output=True,
            timeout=60,
            env={**os.environ, **RAY_ENV},
        )
        if done.returncode == 0:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            err = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise ClusterError(
                f"the Ray head at {address} did not start (exit {proc.poll()}): {err}"
            )
        time.sleep(1.0)


def load(name: str) -> RayCluster | None:
    """The Ray cluster started on cluster ``name``, or None."""
    try:
        raw = json.loads(_record_path(name).read_text())
    except FileNotFoundError:
        return None
    return RayCluster(raw["name"], raw["address"], raw["temp_dir"], tuple(raw["pgids"]))


def _pids_using(temp_dir: str) -> list[int]:
    """Live processes whose command line names ``temp_dir`` (Ray passes its session paths)."""
    if not temp_dir:
        return []
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if temp_dir.encode() in cmdline.read_bytes():
                out.append(int(cmdline.parent.name))
    return sorted(p for p in out if p != os.getpid())


def _alive(pgids: tuple[int, ...], temp_dir: str) -> bool:
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            pass
    return bool(_pids_using(temp_dir))


def _kill(pgids: tuple[int, ...], temp_dir: str, sig: signal.Signals) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in _pids_using(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_ray(name: str) -> list[str]:
    """Stop what ``start_ray`` started on cluster ``name``: SIGTERM the raylets' ``ray start``,
    wait for their process groups to end, then the head's; after 10 s in all SIGKILL what is
    left of the groups and every process naming its temp dir; remove its directory.
    Idempotent; returns what it stopped, one item per string."""
    rc = load(name)
    base = ray_dir(name)
    if rc is None:
        if base.exists():
            shutil.rmtree(base, ignore_errors=True)
            return [f"dir {base}"]
        return []
    stopped = [f"process group {g}" for g in rc.pgids]
    deadline = time.monotonic() + STOP_WAIT_S
    # the raylets together, then the head once they are gone (a raylet whose GCS went first
    # hangs); only each group's leader, `ray start --block`, which stops its children itself
    # (SIGTERM to a whole group at once left the raylet hanging for 10 s)
    for phase in (rc.pgids[1:], rc.pgids[:1]):
        for pgid in phase:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pgid, signal.SIGTERM)
        while _alive(phase, "") and time.monotonic() < deadline:
            time.sleep(0.1)
    _kill(rc.pgids, rc.temp_dir, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while _alive(rc.pgids, rc.temp_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not rc.temp_dir.startswith(str(base)):  # a short one of its own, under /tmp
        shutil.rmtree(rc.temp_dir, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    return [*stopped, f"dir {base}"]


def bench_command(rc: RayCluster, kv_root: str = "/tmp/dpkv") -> str:
    """The ``dualpath bench`` to run against ``rc`` from the root namespace."""
    return (
        f"RAY_AUTH_MODE=disabled dualpath bench --runtime ray --ray-address {rc.address} "
        "--transport tcp "
        f"--kv-root {kv_root} --agents 2 --turns 2 --systems dualpath"
    )
