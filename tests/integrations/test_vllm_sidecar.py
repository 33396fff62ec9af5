"""A side-car under a burst, as the router and the workers reach it: 64 callers at once on a
connection each (the listening queue takes them all), and a ``SidecarPool`` that reuses its
connections and outlives a side-car's restart."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integrations.nodes import running_sidecars

from dualpath.integrations.vllm.node import NodeSpec, SidecarPool, call, wait_ready

LAYERS, BS, ROW = 2, 4, 32
BURST = 64


def _at_once(fn: object, n: int) -> list[object]:
    """``fn()`` in ``n`` threads released together; their results or exceptions."""
    start = threading.Barrier(n)

    def one(_: int) -> object:
        start.wait()
        try:
            return fn()  # type: ignore[operator]
        except Exception as err:  # the test counts them
            return err

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_burst_of_calls_is_all_answered(tmp_path: Path) -> None:
    with running_sidecars(tmp_path, 128, LAYERS, BS, ROW, "ns0") as specs:
        de = specs[1].control
        got = _at_once(lambda: call(de, {"op": "ping"}, 10.0), BURST)
        assert [g for g in got if not isinstance(g, dict)] == []  # a connection each: all in

        pool = SidecarPool()
        slots = _at_once(lambda: pool.call(de, {"op": "alloc", "num_slots": 2, "owner": 5}), BURST)
        assert all(isinstance(s, dict) and len(s["slots"]) == 2 for s in slots), slots
        assert pool.num_connects <= BURST
        # the same burst again: the kept connections carry it (a connection is opened only
        # when every kept one is in use: never more than the callers at once, in all)
        back = _at_once(lambda: pool.call(de, {"op": "release_owner", "owner": 5}), BURST)
        assert [b for b in back if not isinstance(b, dict)] == []
        assert sum(int(b["released"]) for b in back if isinstance(b, dict)) == 2 * BURST
        assert pool.num_connects <= BURST
        assert call(de, {"op": "stats"})["free_slots"] == 128
        pool.close()


def test_a_pool_outlives_a_sidecar_restart(tmp_path: Path) -> None:
    with running_sidecars(tmp_path, 16, LAYERS, BS, ROW, "ns0") as specs:
        spec = specs[0]
        pool = SidecarPool()
        first = pool.call(spec.control, {"op": "ping"})["pid"]
        # the node's side-car replaced (as the supervisor does): same socket, a new process
        call(spec.control, {"op": "ping"})
        moved = NodeSpec(**{**_fields(spec), "buffer_name": spec.buffer_name + "b"})
        proc = _restart(first, moved)
        try:
            again = pool.call(moved.control, {"op": "ping"})["pid"]  # the kept one is stale
            assert again == proc.pid != first
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
        pool.close()


def _fields(spec: NodeSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in NodeSpec.__dataclass_fields__}


def _restart(pid: int, spec: NodeSpec) -> subprocess.Popen[bytes]:
    import os
    import signal
    import time

    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while Path(spec.socket_path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    module = "dualpath.integrations.vllm.sidecar"
    proc = subprocess.Popen([sys.executable, "-m", module, spec.to_json()])
    wait_ready(spec.control, timeout_s=30)
    return proc
