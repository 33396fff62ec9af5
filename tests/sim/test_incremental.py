"""The exact incremental rate solver (``Walk._walk_above``) against the whole-component
one (``local_rates=False``, the oracle): bit for bit on a recorded window of a cluster run
and on random networks."""

from __future__ import annotations

import math
import random

import pytest

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.sim.events import EventLoop
from dualpath.sim.flowreplay import record_window, replay_window
from dualpath.sim.network import FluidNetwork
from dualpath.sim.rates import fill, walk
from dualpath.sim.runner import build_cluster
from dualpath.types import TrafficClass

HIGH, LOW = TrafficClass.HIGH, TrafficClass.LOW
DEFAULT_KEEP = fill.KEEP_MIN_FLOWS


@pytest.fixture(autouse=True)
def keep_every_filling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the subtractions of every filling, however small (the default keeps them from
    ``fill.KEEP_MIN_FLOWS`` flows: exact either way, cheaper on small ones), so that the
    rule runs as often as it can."""
    monkeypatch.setattr(fill, "KEEP_MIN_FLOWS", 0)


@pytest.fixture(scope="module")
def window() -> dict:
    """3 s of a 4P8D cluster (2 EP groups of each kind, 512 agents, MAL 32K, DualPath)
    from simulated 60 s: ~2,000 flow starts, most of them capped layerwise loads and sends."""
    config = apply_overrides(
        preset("ds660b-2p4d"),
        [
            "workload.num_agents=512",
            "workload.mal=32k",
            "cluster.num_prefill_nodes=4",
            "cluster.num_decode_nodes=8",
            "cluster.prefill_ep_nodes=2",
            "cluster.decode_ep_nodes=4",
        ],
    )
    cluster = build_cluster(config, "dualpath", SimConfig())
    return record_window(cluster, 60.0, 63.0)


def test_incremental_rates_on_a_recorded_window_equal_whole_components(window: dict) -> None:
    """Every completion time and every flow's bytes left at the end (the digest) equal the
    whole-component solver's; most settles keep a prefix and far fewer flows are
    re-rated."""
    assert len(window["starts"]) > 1000
    fast = replay_window(window)
    slow = replay_window(window, local_rates=False)
    assert fast["completions"] == slow["completions"] > 1000
    assert fast["digest"] == slow["digest"]
    assert fast["incremental"] > 0.8 * fast["settles"]
    assert fast["rerated"] < 0.1 * slow["rerated"]


def test_incremental_rates_with_the_default_threshold_equal_whole_components(
    window: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default ``KEEP_MIN_FLOWS`` (fillings from the bottom of fewer flows keep
    nothing, and the settles after them refill from the bottom) the same digest, and no
    more settles keep a prefix than when every filling keeps its subtractions."""
    every = replay_window(window)
    monkeypatch.setattr(fill, "KEEP_MIN_FLOWS", DEFAULT_KEEP)
    fast = replay_window(window)
    assert fast["digest"] == replay_window(window, local_rates=False)["digest"]
    assert fast["incremental"] <= every["incremental"]


def test_incremental_rates_on_a_recorded_window_equal_the_local_solver(
    window: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same window with the incremental rule off (the local solver before it): the same
    digest, more flows re-rated."""
    fast = replay_window(window)
    monkeypatch.setattr(walk, "INCREMENTAL", False)
    local = replay_window(window)
    assert local["incremental"] == 0
    assert fast["digest"] == local["digest"]
    assert fast["rerated"] < local["rerated"]


def _random_network(seed: int, local: bool, tm: bool) -> tuple[FluidNetwork, EventLoop, list]:
    """Random resources (capacities from 1 to 100), random paths of 1 to 4 of them (repeats
    allowed), caps from a few shared values and uniform ones (equal caps and equal levels
    both happen), both classes, starts in bursts and spread out, flows restarting on their
    own path when done, cancels and mid-instant queries."""
    rng = random.Random(seed)
    loop = EventLoop()
    net = FluidNetwork(
        loop, traffic_manager=tm, low_floor=rng.choice([0.0, 0.01, 0.1]), local_rates=local
    )
    num_res = rng.randint(2, 12)
    for i in range(num_res):
        net.add_resource(f"r{i}", rng.choice([1.0, 10.0, 100.0, rng.uniform(1.0, 100.0)]))
    shared_caps = [rng.uniform(0.1, 20.0) for _ in range(3)]
    log: list = []
    live: list[int] = []

    def start(i: int, depth: int = 0) -> None:
        path = [rng.randrange(num_res) for _ in range(rng.randint(1, 4))]
        klass = HIGH if rng.random() < 0.15 else LOW
        cap = rng.choice([math.inf, math.inf, *shared_caps, rng.uniform(0.1, 30.0)])
        size = 0.0 if rng.random() < 0.03 else rng.uniform(0.5, 50.0)

        def done() -> None:
            log.append((loop.now, i, depth))
            if depth < 3 and rng.random() < 0.3:
                start(i, depth + 1)
            if rng.random() < 0.05 and live:
                net.cancel_flow(live[rng.randrange(len(live))])

        live.append(net.start_flow(path, size, klass, done, cap))
        if rng.random() < 0.05:
            net.rate_bytes_per_s(live[-1])

    for i in range(rng.randint(30, 150)):
        t = rng.choice([0.0, float(rng.randint(0, 5)), rng.uniform(0.0, 30.0)])
        loop.at(t, lambda i=i: start(i))
    loop.run()
    return net, loop, log


@pytest.mark.parametrize("tm", [True, False])
def test_incremental_rates_on_random_networks_equal_whole_components(tm: bool) -> None:
    """60 random networks: completions (time, flow) and the event history equal the
    whole-component solver's, bit for bit; the incremental rule was used, and re-rated
    fewer flows than the local solver without it."""
    used = fewer = 0
    for seed in range(60):
        fast, fast_loop, fast_log = _random_network(seed, True, tm)
        _, slow_loop, slow_log = _random_network(seed, False, tm)
        assert fast_log == slow_log, f"seed {seed}"
        assert fast_loop.log_digest() == slow_loop.log_digest(), f"seed {seed}"
        used += fast.rates.num_incremental
        fewer += fast.num_settled_flows
    assert used > 500
    previous = walk.INCREMENTAL
    try:
        walk.INCREMENTAL = False
        more = sum(_random_network(seed, True, tm)[0].num_settled_flows for seed in range(60))
    finally:
        walk.INCREMENTAL = previous
    assert fewer < more


def _cap_below_prefix(local: bool) -> tuple[float, int]:
    """One resource of 1 B/s: flows capped at 0.3 and 0.2 and an uncapped one (0.5 left
    for it); at 1 s a flow capped at 0.1 starts, below the 0.2 flow kept from the last
    filling. The uncapped flow's rate and the settles that kept a prefix."""
    loop = EventLoop()
    net = FluidNetwork(loop, traffic_manager=False, local_rates=local)
    a = net.add_resource("a", 1.0)
    net.start_flow([a], 100.0, LOW, lambda: None, 0.3)
    net.start_flow([a], 100.0, LOW, lambda: None, 0.2)
    u = net.start_flow([a], 100.0, LOW, lambda: None)
    loop.run(until_s=1.0)
    net.start_flow([a], 100.0, LOW, lambda: None, 0.1)
    loop.run(until_s=2.0)
    return net.rate_bytes_per_s(u), net.rates.num_incremental


def test_a_start_capped_below_the_kept_prefix_is_subtracted_in_its_order() -> None:
    """The new cap (0.1) freezes before the kept 0.2: the oracle leaves (1 - 0.1) - 0.2 -
    0.3 for the uncapped flow, 0.39999999999999997; keeping 0.2 and subtracting 0.1 after
    it would give 0.4000000000000001. A started flow's cap bounds the level kept below."""
    fast, used = _cap_below_prefix(True)
    slow, _ = _cap_below_prefix(False)
    assert fast == slow == 1.0 - 0.1 - 0.2 - 0.3
    assert used > 0
