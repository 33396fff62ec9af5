"""A window of a cluster run's flows, recorded and replayed on a bare fluid network.

``record_window`` runs a built cluster to ``t_from``, snapshots every live flow (path, bytes
left, class, rate cap), then records every flow start (time, path, size, class, cap) until
``t_to``, with the network's resources and settings (it wraps the network's ``start_flow``
of that one run: a measuring tool, not an observation hook of the simulator).
``replay_window`` starts the snapshot's flows at ``t_from`` on a new ``FluidNetwork`` +
``EventLoop`` and the recorded starts at their recorded times (open loop: a completion
starts nothing) and returns its figures with a digest of every completion (time, flow) and
of the bytes left in every live flow at the end: two rate solvers that rate flows bit for
bit alike give the same digest. ``benchmarks/bench_replay.py`` measures with these;
``tests/sim/test_network.py`` holds the incremental solver to the whole-component one on a
recorded window.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

from dualpath.sim.events import EventLoop, Priority
from dualpath.sim.network import FluidNetwork
from dualpath.types import TrafficClass


def record_window(cluster: Any, t_from: float, t_to: float) -> dict[str, Any]:
    """Run ``cluster`` (a built ``Cluster``) to ``t_to`` and return the window from
    ``t_from`` as plain data (JSON-able)."""
    cluster.loop.run(until_s=t_from)
    net = cluster.net
    net.rates.settle()
    table = net._t  # the recorder reads the network's table directly
    initial = []
    for fid in sorted(table.slot_of):
        s = table.slot_of[fid]
        left = net.remaining_bytes(fid)
        if table.f_path[s] and left > 0.0:
            initial.append([list(table.f_path[s]), left, table.f_cls[s], table.f_cap[s]])
    starts: list[list[Any]] = []
    loop, start_flow = cluster.loop, net.start_flow

    def recording_start(
        path: Any, size: float, klass: Any, on_done: Any, cap: float = math.inf
    ) -> int:
        starts.append([loop.now, list(path), float(size), int(klass), float(cap)])
        return int(start_flow(path, size, klass, on_done, cap))

    net.start_flow = recording_start
    loop.run(until_s=t_to)
    names = sorted(net._names, key=net._names.__getitem__)
    return {
        "traffic_manager": net._tm,
        "low_floor": net.rates._floor,
        "resources": [[n, net.capacity(net.resource_id(n))] for n in names],
        "from_s": t_from,
        "to_s": t_to,
        "initial": initial,
        "starts": starts,
    }


def replay_window(
    data: dict[str, Any], seconds: float | None = None, local_rates: bool = True
) -> dict[str, Any]:
    """Replay a recorded window (all of it, or its first ``seconds``); ``local_rates=False``
    on the whole-component solver. Returns CPU seconds, counters and the digest."""
    t0 = float(data["from_s"])
    end = float(data["to_s"]) if seconds is None else t0 + seconds
    loop = EventLoop()
    net = FluidNetwork(
        loop,
        traffic_manager=data["traffic_manager"],
        low_floor=data["low_floor"],
        local_rates=local_rates,
    )
    for name, cap in data["resources"]:
        net.add_resource(name, cap)
    classes = {int(k): k for k in TrafficClass}
    done: list[tuple[float, int]] = []
    fids: list[int] = []

    def finisher(i: int) -> Callable[[], None]:
        return lambda: done.append((loop.now, i))

    def starter(flows: list[list[Any]], first: int) -> Callable[[], None]:
        def start() -> None:
            for i, (p, size, klass, cap) in enumerate(flows, first):
                fids.append(net.start_flow(p, size, classes[klass], finisher(i), cap))

        return start

    n = len(data["initial"])
    loop.at(t0, starter(data["initial"], 0), Priority.START, "replay.start")
    batch: list[list[Any]] = []
    batch_s = t0
    for t, p, size, klass, cap in data["starts"]:
        if t >= end:
            break
        if t != batch_s and batch:
            loop.at(batch_s, starter(batch, n), Priority.START, "replay.start")
            n += len(batch)
            batch = []
        batch_s = t
        batch.append([p, size, klass, cap])
    if batch:
        loop.at(batch_s, starter(batch, n), Priority.START, "replay.start")
        n += len(batch)
    cpu0 = time.process_time()
    loop.run(until_s=end)
    cpu = time.process_time() - cpu0
    h = hashlib.sha256(repr(done).encode())
    h.update(repr([net.remaining_bytes(fid) for fid in fids]).encode())
    solver = net.rates
    return {
        "window_s": [t0, end],
        "flows": n,
        "cpu_s": cpu,
        "events": loop.num_processed,
        "settles": net.num_settles,
        "rerated": net.num_settled_flows,
        "fallbacks": solver.num_fallbacks,
        "retries": solver.num_retries,
        "incremental": solver.num_incremental,
        "whole": solver.num_whole,
        "completions": len(done),
        "digest": h.hexdigest()[:16],
    }
