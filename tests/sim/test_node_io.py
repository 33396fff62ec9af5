"""Storage read queue: FIFO order, reported read starts and buffer backpressure."""

from __future__ import annotations

from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.node_io import NodeIO
from dualpath.sim.request import Req
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath

GB = 1e9


def _node(
    capacity_bytes: float, at_once: int = 1
) -> tuple[EventLoop, NodeIO, list[tuple[int, float]]]:
    loop = EventLoop()
    net = FluidNetwork(loop)
    snic = net.add_resource("snic", 1 * GB)
    done: list[tuple[int, float]] = []
    node = NodeIO(
        0,
        KVPath.STORAGE_TO_PE_BUFFER,
        (snic,),
        capacity_bytes,
        at_once,
        Transfers(loop, net, oracle=False),
        lambda req, _node: done.append((req.request_id, loop.now)),
    )
    return loop, node, done


def _req(rid: int) -> Req:
    return Req(rid, rid, 0, 1000, 900, 2, 0.0)


def test_fifo_one_at_a_time_at_full_rate() -> None:
    loop, node, done = _node(100 * GB)
    started: list[tuple[int, float, float]] = []
    node.on_read_start = lambda req, _n, size: started.append((req.request_id, loop.now, size))
    for rid, size in ((0, 2), (1, 1), (2, 3)):
        node.enqueue(_req(rid), int(size * 100), size * GB)
    loop.run()
    assert [r for r, _ in done] == [0, 1, 2]
    assert [t for _, t in done] == [2.0, 3.0, 6.0]
    assert started == [(0, 0.0, 2 * GB), (1, 2.0, 1 * GB), (2, 3.0, 3 * GB)]


def test_backpressure_waits_for_buffer_space() -> None:
    loop, node, done = _node(3 * GB, at_once=2)
    node.enqueue(_req(0), 200, 2 * GB)
    node.enqueue(_req(1), 200, 2 * GB)  # does not fit next to request 0
    loop.run()
    assert [r for r, _ in done] == [0]
    assert node.in_flight == 0 and len(node.queue) == 1
    loop.at(5.0, lambda: node.release(2 * GB))  # request 0's KV leaves the buffer
    loop.run()
    assert done[1] == (1, 7.0)
    assert node.buffer_peak_bytes == 2 * GB
    # the SNIC idled from 2 s (read 0 landed) to 5 s (space freed) with a read waiting;
    # from 0 to 2 s request 1 waited too, but read 0 kept the SNIC busy
    assert node.buffer_blocked_s == 3.0


def test_no_blocked_time_when_the_queue_is_merely_empty() -> None:
    loop, node, _ = _node(3 * GB)
    node.enqueue(_req(0), 200, 2 * GB)
    loop.run()
    loop.at(10.0, lambda: node.enqueue(_req(1), 100, 1 * GB))  # fits beside request 0's KV
    loop.run()
    assert node.buffer_blocked_s == 0.0


def test_oversized_read_starts_on_an_empty_buffer() -> None:
    loop, node, done = _node(1 * GB)
    node.enqueue(_req(0), 100, 4 * GB)
    loop.run()
    assert done == [(0, 4.0)]
