"""Coalescing channels (H2D per DE, persistence per decode node): FIFO batches, one flow."""

from __future__ import annotations

from dualpath.sim.channel import Channel
from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath

GB = 1e9


def test_batches_what_queues_behind_the_flow_in_flight() -> None:
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = net.add_resource("cnic", 1 * GB)
    landed: list[tuple[float, list[str]]] = []
    ch: Channel[str] = Channel(
        KVPath.DE_BUFFER_TO_DE_HBM,
        (link,),
        Transfers(loop, net, oracle=False),
        lambda items: landed.append((loop.now, items)),
    )
    loop.at(0.0, lambda: ch.send(2 * GB, "a"))
    loop.at(0.5, lambda: ch.send(1 * GB, "b"))
    loop.at(1.0, lambda: ch.send(1 * GB, "c"))
    loop.run()
    # "a" alone (0 → 2 s); "b" and "c" queued meanwhile go as one flow (2 → 4 s)
    assert landed == [(2.0, ["a"]), (4.0, ["b", "c"])]
    assert ch.num_flows == 2 and not ch.busy
    assert net.bytes_carried(link) == 4 * GB


def test_bytes_without_items_and_the_oracle() -> None:
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = net.add_resource("snic_write", 1 * GB)
    writes: Channel[None] = Channel(
        KVPath.DE_TO_STORAGE, (link,), Transfers(loop, net, oracle=False)
    )
    writes.send(3 * GB)
    writes.send(1 * GB)
    loop.run()
    assert loop.now == 4.0 and writes.num_flows == 2
    free: list[float] = []
    oracle: Channel[int] = Channel(
        KVPath.DE_BUFFER_TO_DE_HBM,
        (link,),
        Transfers(loop, net, oracle=True),
        lambda items: free.append(loop.now),
    )
    oracle.send(5 * GB, 1)
    loop.run()
    assert free == [4.0]  # the Oracle's H2D takes no time


def test_min_gap_batches_writes() -> None:
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = net.add_resource("snic_write", 1 * GB)
    ch: Channel[None] = Channel(
        KVPath.DE_TO_STORAGE, (link,), Transfers(loop, net, oracle=False), min_gap_s=10.0
    )
    for t in (0.0, 1.0, 2.0, 3.0, 12.0):
        loop.at(t, lambda: ch.send(0.5 * GB))
    loop.run()
    # flows start at 0 (0.5 GB), 10 (the three queued meanwhile) and 20 (the last one)
    assert ch.num_flows == 3
    assert loop.now == 20.5
    assert net.bytes_carried(link) == 2.5 * GB


def test_without_coalescing_each_send_lands_in_order_with_its_own_bytes() -> None:
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = net.add_resource("snic_write", 1 * GB)
    landed: list[tuple[float, list[str]]] = []
    ch: Channel[str] = Channel(
        "de_to_storage",
        (link,),
        Transfers(loop, net, oracle=False),
        lambda items: landed.append((loop.now, items)),
        coalesce=False,
    )
    loop.at(0.0, lambda: ch.send(2 * GB, "a"))
    loop.at(0.5, lambda: ch.send(1 * GB, "b"))
    loop.at(1.0, lambda: ch.send(1 * GB, "c"))
    loop.run()
    # one flow at a time, FIFO: "b" lands after its own gigabyte (3 s), not with "c" (4 s)
    assert landed == [(2.0, ["a"]), (3.0, ["b"]), (4.0, ["c"])]
    assert ch.num_flows == 3 and not ch.busy and not ch.backlog
    assert net.bytes_carried(link) == 4 * GB
