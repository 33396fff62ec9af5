"""Speed of the simulator core: EventLoop schedule+pop, and FluidNetwork under churn.

Run: .venv/bin/python benchmarks/bench_network.py [--flows 2000 --resources 200 ...]
Prints events/s of the bare loop and flows/s, loop events/s and recomputes/s of a network
that keeps ``--flows`` flows in flight over random ``--hops``-resource paths.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import time

from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.types import TrafficClass


def bench_loop(num_events: int, num_pending: int, seed: int) -> None:
    rng = random.Random(seed)
    delays = [rng.random() for _ in range(num_events)]
    loop = EventLoop()
    after = loop.after
    it = iter(delays)

    def tick() -> None:
        delay = next(it, None)
        if delay is not None:
            after(delay, tick)

    for _ in range(num_pending):
        after(rng.random(), tick)
    t0, c0 = time.perf_counter(), time.process_time()
    loop.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = loop.num_processed
    print(
        f"event loop, steady state ({num_pending} pending): {n:,} events in {wall:.2f} s"
        f" = {n / wall:,.0f} events/s wall, {n / cpu:,.0f} per CPU-s (schedule + pop + log)"
    )
    loop = EventLoop()
    at = loop.at
    noop = int
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(num_events):
        at(i * 1e-6, noop)
    loop.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"event loop, schedule all then run ({num_events:,} in heap): "
        f"{num_events / wall:,.0f} events/s wall, {num_events / cpu:,.0f} per CPU-s"
    )


def bench_network(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    loop = EventLoop()
    net = FluidNetwork(loop, traffic_manager=not args.no_tm)
    links = [net.add_resource(f"r{i}", rng.uniform(10e9, 50e9)) for i in range(args.resources)]
    target = args.events // 2  # timed: this many finishes, each replaced by a start
    state = {"finished": 0}

    def start() -> None:
        path = rng.sample(links, args.hops)
        klass = TrafficClass.HIGH if rng.random() < args.high_share else TrafficClass.LOW
        net.start_flow(path, rng.uniform(1e6, 1e8), klass, done)

    def done() -> None:
        state["finished"] += 1
        start()

    for _ in range(args.flows):
        start()
    loop.run(until_s=0.0)  # first rating of the initial flows: not timed
    settles0, events0, rated0 = net.num_settles, loop.num_processed, net.num_settled_flows
    t0, c0 = time.perf_counter(), time.process_time()
    loop.run(stop=lambda: state["finished"] >= target)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    num_settles, num_events = net.num_settles - settles0, loop.num_processed - events0
    mean_component = (net.num_settled_flows - rated0) / max(num_settles, 1)
    n_flows = state["finished"]
    print(
        f"network: {args.resources} resources, {args.flows} concurrent flows, {args.hops}-hop"
        f" paths, traffic manager {'off' if args.no_tm else 'on'}"
    )
    print(
        f"  {n_flows:,} flows ({2 * n_flows:,} start/finish events) in {wall:.2f} s"
        f" ({cpu:.2f} CPU-s):"
        f" {n_flows / wall:,.0f} flows/s, {2 * n_flows / wall:,.0f} flow events/s,"
        f" {num_events / wall:,.0f} loop events/s"
    )
    print(
        f"  {num_settles:,} rate recomputes ({num_settles / wall:,.0f}/s,"
        f" {1e3 * wall / max(num_settles, 1):.3f} ms each, {mean_component:.0f} flows each),"
        f" simulated {loop.now:.3f} s,"
        f" peak RSS {peak_mib:.0f} MiB"
    )
    total = sum(net.bytes_carried(r) for r in links)
    print(f"  bytes carried (all resources): {total:.4e}; finite: {math.isfinite(total)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--loop-events", type=int, default=1_000_000)
    p.add_argument("--pending", type=int, default=1_000)
    p.add_argument("--resources", type=int, default=200)
    p.add_argument("--flows", type=int, default=2_000)
    p.add_argument("--hops", type=int, default=3)
    p.add_argument("--events", type=int, default=50_000, help="flow start + finish events")
    p.add_argument("--high-share", type=float, default=0.2, help="fraction of HIGH flows")
    p.add_argument("--no-tm", action="store_true", help="traffic manager off")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-loop", action="store_true")
    args = p.parse_args()
    if not args.skip_loop:
        bench_loop(args.loop_events, args.pending, args.seed)
    bench_network(args)


if __name__ == "__main__":
    main()
