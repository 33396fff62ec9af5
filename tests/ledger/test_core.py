"""The core every shell reports through: the agent driver (when an agent's next turn is
submitted), the run's counters, and the DEs' generated tokens feeding the view's tok_e."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dualpath.config import preset
from dualpath.ledger import AgentDriver, Core, Phase, RunCounters, Topology, Turn
from dualpath.ledger.counters import RUNTIME_PATHS, SIM_PATHS
from dualpath.policy import Assign, make_policy
from dualpath.types import KVPath, ReadSide

TOPO = Topology(2, 1, 1, True, True)  # PEs 0, 1 on node 0; DEs 2, 3 on node 1


@dataclass
class Script:
    agent_id: int
    turns: int
    submitted: int = 0

    @property
    def finished(self) -> bool:
        return self.submitted >= self.turns


def _driver() -> tuple[AgentDriver[Script], list[tuple[int, float]]]:
    log: list[tuple[int, float]] = []

    def submit(agent: Script, arrival_s: float) -> None:
        agent.submitted += 1
        log.append((agent.agent_id, arrival_s))

    return AgentDriver(submit), log


def test_next_turn_is_submitted_at_once_without_pending_writes() -> None:
    driver, log = _driver()
    driver.add(Script(0, 2))
    driver.next_turn(0, 1.0)
    driver.next_turn(0, 2.5)
    driver.next_turn(0, 4.0)  # no turn left: nothing submitted
    assert log == [(0, 1.0), (0, 2.5)]
    assert not driver.busy


def test_a_held_turn_waits_for_every_key_and_keeps_its_arrival() -> None:
    driver, log = _driver()
    driver.add(Script(0, 3))
    driver.next_turn(0, 0.0)
    driver.next_turn(0, 5.0, pending=["a", "b"])
    assert log == [(0, 0.0)] and driver.holds(0)
    driver.durable("a")
    driver.durable("x")  # nobody waits on it
    assert log == [(0, 0.0)]
    driver.durable("b")
    assert log == [(0, 0.0), (0, 5.0)] and not driver.holds(0)


def test_a_key_two_agents_wait_on_releases_both_in_agent_id_order() -> None:
    driver, log = _driver()
    for agent_id in (3, 1):
        driver.add(Script(agent_id, 2, submitted=1))
    driver.next_turn(3, 2.0, pending=["shared"])
    driver.next_turn(1, 1.0, pending=["shared", "own"])
    driver.durable("shared")
    assert log == [(3, 2.0)]
    driver.durable("own")
    assert log == [(3, 2.0), (1, 1.0)]


def test_lost_writes_release_every_held_turn_and_forget_spares_held_agents() -> None:
    driver, log = _driver()
    driver.add(Script(0, 2, submitted=1))
    driver.add(Script(1, 1, submitted=1))
    driver.next_turn(0, 3.0, pending=["k"])
    driver.forget(0)  # held: kept
    driver.forget(1)  # finished, nothing held: dropped
    assert 0 in driver and 1 not in driver
    driver.release_all()
    assert log == [(0, 3.0)]
    driver.durable("k")  # the released key no longer submits anything
    assert log == [(0, 3.0)]


def test_counters_count_bytes_per_path_and_passes() -> None:
    c = RunCounters()
    assert tuple(c.bytes_by_path) == RUNTIME_PATHS and not any(c.bytes_by_path.values())
    c.moved(KVPath.STORAGE_TO_PE_BUFFER, 100)
    c.moved(KVPath.STORAGE_TO_DE_BUFFER, 40)
    c.moved(KVPath.DE_TO_STORAGE, 7)
    c.pass_started([(64, 10), (0, 30)])
    c.pass_started([(5, 5)])
    c.pass_done(40, 1.0, 1.5)
    c.read_window(1, 0.0, 2.0)
    assert c.read_bytes() == 140 and c.bytes_by_path[KVPath.DE_TO_STORAGE] == 7
    assert (c.passes, c.pass_chunks, c.max_pass_tokens) == (2, 3, 104)
    assert (c.pass_new_tokens, c.pass_busy_s, c.read_windows) == (40, 0.5, {1: [(0.0, 2.0)]})


def test_counters_over_the_simulators_paths_and_whole_bytes() -> None:
    sim = RunCounters.over(SIM_PATHS)
    assert tuple(sim.bytes_by_path) == SIM_PATHS and KVPath.BUFFER_TO_PE_HBM not in SIM_PATHS
    assert KVPath.PE_BUFFER_TO_PE_HBM in SIM_PATHS and KVPath.DE_BUFFER_TO_PE_HBM in SIM_PATHS
    sim.moved(KVPath.PE_BUFFER_TO_PE_HBM, 2.5)
    assert sim.bytes_by_path[KVPath.PE_BUFFER_TO_PE_HBM] == 2.5
    rt = RunCounters()
    rt.moved(KVPath.BUFFER_TO_PE_HBM, 3)
    whole = rt.whole_bytes()
    assert whole[KVPath.BUFFER_TO_PE_HBM] == 3 and all(type(n) is int for n in whole.values())


def test_core_counts_generated_tokens_into_the_view_and_keeps_records() -> None:
    submitted: list[int] = []
    core: Core[Script] = Core(
        TOPO,
        None,
        10_000,
        64,
        lambda a, t: submitted.append(a.agent_id),  # type: ignore[arg-type]
    )
    core.count_generated()
    turn = Turn(1, 0, 0, prompt_tokens=100, hit_tokens=0, output_tokens=4, arrival_s=0.0)
    core.ledger.submit(turn, 0.0)
    core.ledger.assign(turn, Assign(1, 0, 3, ReadSide.NONE, 0, 0), 0.0)
    turn.prefill_start_s = 0.5
    core.ledger.pass_started(turn, 0.5)
    core.ledger.first_token(turn, 1.0)
    core.generated_tokens(3, 2)
    assert core.ledger.view().engine_tokens()[3] == 102  # prompt + generated (design §13.4)
    core.generated_tokens(3, -2)
    turn.second_token_s, turn.finish_s = 1.5, 2.0
    core.ledger.finish(turn, 2.0)
    assert core.ledger.view().engine_tokens()[3] == 0
    assert [r.request_id for r in core.records] == [1]
    with pytest.raises(KeyError):
        core.generated_tokens(0, 1)  # a PE generates nothing


def test_a_turn_cancelled_while_queued_is_aborted_and_dropped_at_the_pull() -> None:
    """The policy holds a queued turn: the core marks it, aborts it when the policy assigns
    it (it leaves every counter) and drops it from the table; the other turn goes on."""
    cfg = preset("tiny-1p1d")
    topo = Topology.from_config(cfg)
    core: Core[Script, Turn] = Core(topo, make_policy(cfg), 10_000, 64, lambda a, t: None)
    gone = Turn(0, 0, 0, prompt_tokens=300, hit_tokens=128, output_tokens=5, arrival_s=0.0)
    kept = Turn(1, 1, 0, prompt_tokens=100, hit_tokens=0, output_tokens=3, arrival_s=0.0)
    core.submit(gone, 0.0)
    core.submit(kept, 0.0)
    assert core.cancel(gone, 0.5) is False  # queued: nothing to free now
    assert gone.cancelled and gone.phase is Phase.QUEUED
    assert [t.request_id for t, _ in core.pull(1.0)] == [1]
    assert gone.phase is Phase.ABORTED and set(core.turns) == {1}
    view = core.view()
    assert view.nodes[0].read_queue_tokens == 0  # its read never counted
    assert sum(e.seq for e in view.engines) == 2  # only the kept turn, on its PE and DE
    assert core.cancel(kept, 1.5) is True  # assigned: the shell frees what it holds, aborts
    core.abort(kept, 1.5)
    assert core.forget(1) is kept and not core.turns
    assert not any(e.seq or e.tokens for e in core.view().engines)
