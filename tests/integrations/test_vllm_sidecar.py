"""A side-car under a burst, as the router and the workers reach it: 64 callers at once on a
connection each (the listening queue takes them all), and a ``SidecarPool`` that reuses its
connections and outlives a side-car's restart."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integrations.nodes import running_sidecars

from dualpath.integrations.vllm.node import NodeSpec, SidecarPool, _connect, call, wait_ready
from dualpath.kv.store import QUARANTINE

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


# every operation a side-car serves, each with arguments it would carry out
def _every_op(spec: NodeSpec, peer: NodeSpec) -> list[dict[str, object]]:
    return [
        {"op": "read", "keys": ["k0"], "slots": [0]},
        {"op": "write", "keys": ["k0"], "slots": [0]},
        {"op": "parts", "parts": []},
        {"op": "settle", "keys": ["k0"], "timeout_s": 0.1},
        {"op": "stats"},
        {"op": "ping"},
        {"op": "describe"},
        {"op": "alloc", "num_slots": 3, "owner": 9},
        {"op": "release", "slots": [0, 1], "owner": 9},
        {"op": "release_owner", "owner": 9},
        {"op": "region"},
        {"op": "push", "slots": [0], "to": peer.control, "to_slots": [0]},
    ]


def test_a_sidecar_with_a_token_refuses_every_operation_without_it(tmp_path: Path) -> None:
    secret = "s3cret-" + "ab" * 16
    with running_sidecars(tmp_path, 16, LAYERS, BS, ROW, "ns0", token=secret) as specs:
        spec = specs[1]
        held = call(spec.control, {"op": "alloc", "num_slots": 2, "owner": 9}, token=secret)
        assert len(held["slots"]) == 2
        ops = _every_op(spec, specs[0])
        every = (
            "read write parts settle stats ping describe alloc release release_owner region push"
        )
        assert {o["op"] for o in ops} == set(every.split())
        for op in ops:
            for wrong in ("", "s3cret", secret + "x"):
                try:
                    call(spec.control, op, 5.0, token=wrong)
                except ValueError as err:
                    assert "unauthorized" in str(err) and secret not in str(err), (op, err)
                else:
                    raise AssertionError(f"{op['op']} with token {wrong!r} was carried out")
        pool = SidecarPool(token="nope")  # a kept connection is refused the same way
        for _ in range(2):
            try:
                pool.call(spec.control, {"op": "release_owner", "owner": 9})
            except ValueError as err:
                assert "unauthorized" in str(err)
            else:
                raise AssertionError("a pooled call with a wrong token was carried out")
        pool.close()
        for junk in (b"not json\n", b"[1, 2]\n"):  # no request at all: refused, closed
            with _connect(spec.control, 5.0) as s:
                s.sendall(junk)
                answer = s.makefile("rb").readline()
                assert b"unauthorized" in answer and s.recv(1) == b"", answer
        # nothing was done: the two slots are still held, nothing queued or pushed
        stats = call(spec.control, {"op": "stats"}, token=secret)
        assert stats["free_slots"] == 14
        assert stats["pending_writes"] == 0 and stats.get("bytes_pushed", 0) == 0
        assert stats["refused_requests"] == 3 * len(ops) + 2 + 2
        # the right token: every operation is carried out, and it is never echoed back
        described = call(spec.control, {"op": "describe"}, token=secret)
        assert secret not in json.dumps(described) and secret not in json.dumps(stats)
        got = call(spec.control, {"op": "release_owner", "owner": 9}, token=secret)
        assert got["released"] == 2
        # the nodes reach each other with it too (a side-car asks its peer for its region)
        for n in specs.values():
            wait_ready(n.control, token=secret)
        try:
            wait_ready(spec.control, timeout_s=2, token="")
        except ValueError as err:
            assert "unauthorized" in str(err)
        else:
            raise AssertionError("a ping without a token was answered")


def test_a_write_whose_path_is_in_the_way_is_counted_and_not_tried_again(
    tmp_path: Path,
) -> None:
    """The storage nodes' one write-failure policy (``kv.worker.WriteFailures``) in the
    side-car: a block whose directory is a file that cannot be moved aside fails (ENOTDIR), is
    counted in ``stats`` and its slot freed; the same block again is dropped unread, counted
    again."""
    key = "ab" + "0" * 62
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / key[:2]).write_text("a file where the block's folder goes")
    (tmp_path / "kv" / QUARANTINE).write_text("and one where it would be moved aside")
    with running_sidecars(tmp_path, 8, LAYERS, BS, ROW, "ns0") as specs:
        de = specs[1].control
        for expected in (1, 2):
            slots = call(de, {"op": "alloc", "num_slots": 1, "owner": 7})["slots"]
            assert call(de, {"op": "write", "keys": [key], "slots": slots, "owner": 7}) == {
                "queued": 1
            }
            deadline = time.monotonic() + 10
            while (stats := call(de, {"op": "stats"}))["unfinished_writes"]:
                assert time.monotonic() < deadline, stats
                time.sleep(0.02)
            assert stats["failed_writes"] == expected and stats["bytes_written"] == 0
            assert stats["free_slots"] == 8  # the slot came back either way
    assert (tmp_path / "kv" / key[:2]).is_file()  # nothing moved aside: it was never the block
