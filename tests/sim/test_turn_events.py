"""The simulator reports every turn's life as events; subscribing changes nothing."""

from __future__ import annotations

from collections import Counter

from dualpath.config.sim import SimConfig
from dualpath.ledger import (
    Assigned,
    FirstToken,
    Persisted,
    ReadDone,
    Submitted,
    TurnDone,
)
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster

from .conftest import small_config


def test_each_turn_reports_its_phases_once_in_order_and_observers_are_passive() -> None:
    config = small_config("ds27b-1p1d", 4, "32k")
    quiet = build_cluster(config, "dualpath", SimConfig())
    run_cluster(quiet)
    cluster = build_cluster(config, "dualpath", SimConfig())
    kinds = (Submitted, Assigned, ReadDone, FirstToken, TurnDone)
    order: dict[int, list[str]] = {}
    persisted: list[float] = []
    for kind in kinds:
        cluster.events.subscribe(
            kind, lambda ev: order.setdefault(ev.turn.request_id, []).append(type(ev).__name__)
        )
    cluster.events.subscribe(Persisted, lambda ev: persisted.append(ev.num_bytes))
    run_cluster(cluster)
    result = collect(cluster)
    assert cluster.loop.log_digest() == quiet.loop.log_digest()
    assert len(order) == result.num_turns == len(cluster.records)
    expected = [k.__name__ for k in kinds]
    assert Counter(tuple(v) for v in order.values()) == Counter({tuple(expected): len(order)})
    assert sum(persisted) == result.path_bytes["de_to_storage"] > 0
