"""``sim.next_turn_after_persist``: an agent's next turn waits until the previous turn's
block writes have landed (the runtime's rule), arriving at the previous turn's finish."""

from __future__ import annotations

from collections import defaultdict

import pytest

from dualpath.config.sim import SimConfig
from dualpath.ledger import Persisted, Submitted, TransferDone, TurnDone
from dualpath.sim.runner import build_cluster, run_cluster

from .conftest import small_config


def _run(gate: bool, interval_s: float) -> dict[str, object]:
    config = small_config("ds27b-1p1d", 8, "32k")
    cluster = build_cluster(
        config, "dualpath", SimConfig(next_turn_after_persist=gate, persist_interval_s=interval_s)
    )
    node_of_path = {w.path: node for node, w in cluster.writers.items()}
    sent: dict[int, float] = defaultdict(float)  # node → bytes handed to storage so far
    landed: dict[int, list[tuple[float, float]]] = defaultdict(list)  # node → (t, bytes)
    submits: dict[tuple[int, int], tuple[float, float]] = {}  # (agent, turn) → (t, arrival)
    finishes: dict[tuple[int, int], tuple[float, int]] = {}  # (agent, turn) → (t, DE node)
    # (agent, turn) → the node's bytes handed to storage up to the turn's last write
    written: dict[tuple[int, int], float] = {}

    def on_persist(ev: Persisted) -> None:
        sent[ev.node] += ev.num_bytes
        assert ev.turn is not None
        written[ev.turn.agent_id, ev.turn.turn_index] = sent[ev.node]

    cluster.events.subscribe(Persisted, on_persist)

    def on_transfer(ev: TransferDone) -> None:
        if ev.kind == "de_to_storage":
            landed[node_of_path[ev.path]].append((ev.now, ev.size_bytes))

    def on_submit(ev: Submitted) -> None:
        submits[ev.turn.agent_id, ev.turn.turn_index] = (ev.now, ev.turn.arrival_s)

    def on_done(ev: TurnDone) -> None:
        t = ev.turn
        finishes[t.agent_id, t.turn_index] = (ev.now, cluster.topo.node_of(t.de))

    cluster.events.subscribe(TransferDone, on_transfer)
    cluster.events.subscribe(Submitted, on_submit)
    cluster.events.subscribe(TurnDone, on_done)
    run_cluster(cluster)
    assert cluster.num_turns_done == cluster.num_turns_total > 0
    return {"written": written, "landed": landed, "submits": submits, "finishes": finishes}


def _bytes_until(events: list[tuple[float, float]], t: float) -> float:
    return sum(b for when, b in events if when <= t)


@pytest.mark.parametrize("interval_s", [0.0, 1.0])
def test_next_turn_is_submitted_once_the_previous_turns_writes_landed(interval_s: float) -> None:
    run = _run(True, interval_s)
    written, landed = run["written"], run["landed"]
    submits, finishes = run["submits"], run["finishes"]
    assert isinstance(submits, dict) and isinstance(finishes, dict)
    assert isinstance(written, dict) and isinstance(landed, dict)
    waited = checked = 0
    for (agent, turn), (submit_s, arrival_s) in submits.items():
        prev = finishes.get((agent, turn - 1))
        if prev is None:
            continue
        finish_s, node = prev
        assert arrival_s == finish_s  # it arrived at the previous turn's finish
        if (agent, turn - 1) in written:
            # one write in flight per node, FIFO: the previous turn's writes, and all bytes
            # handed to storage before them, have landed when the next turn is submitted
            assert _bytes_until(landed[node], submit_s) >= written[agent, turn - 1]
            checked += 1
        waited += submit_s > finish_s
    assert checked > 0 and waited > 0  # the gate held some turns (not vacuous)


def test_without_the_gate_the_next_turn_is_submitted_at_the_finish() -> None:
    run = _run(False, 1.0)
    submits, finishes = run["submits"], run["finishes"]
    assert isinstance(submits, dict) and isinstance(finishes, dict)
    pairs = [
        (submit_s, arrival_s, finishes[agent, turn - 1][0])
        for (agent, turn), (submit_s, arrival_s) in submits.items()
        if (agent, turn - 1) in finishes
    ]
    assert pairs and all(s == a == f for s, a, f in pairs)


def test_with_the_gate_writes_are_not_spaced_for_batching() -> None:
    config = small_config("ds27b-1p1d", 8, "32k")
    digests = []
    for interval_s in (0.0, 1.0):
        sim = SimConfig(next_turn_after_persist=True, persist_interval_s=interval_s)
        cluster = build_cluster(config, "dualpath", sim)
        run_cluster(cluster)
        digests.append(cluster.loop.log_digest())
    assert digests[0] == digests[1]
