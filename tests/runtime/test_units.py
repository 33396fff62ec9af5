"""Small runtime pieces: HIGH traffic sizes, agent state, options."""

from __future__ import annotations

import pytest

from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.result import union_s
from dualpath.workload.scripts import AgentScript


def test_agent_state_grows_its_context() -> None:
    agent = AgentState.from_script(AgentScript(0, ((1, 2), (3,)), (2, 1)))
    assert agent.next_turn() == ((1, 2), 2)
    agent.finish_turn((1, 2), (7, 8))
    assert agent.context == (1, 2, 7, 8) and agent.next_turn() == ((3,), 1)
    agent.finish_turn((1, 2, 7, 8, 3), (9,))
    assert agent.finished and agent.next_turn() is None


def test_union_of_read_windows() -> None:
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_s([]) == 0.0


def test_options_derive_policy_and_pacing() -> None:
    assert RuntimeOptions(system="oracle").spec.policy == "dualpath"
    assert not RuntimeOptions(system="oracle").paced_kv
    assert RuntimeOptions(system="basic").paced_kv
    with pytest.raises(ValueError, match="buffer_slots"):
        RuntimeOptions(buffer_slots=-1)


def test_one_token_turn_records_its_first_token_as_second() -> None:
    from dualpath.runtime.requests import Req

    req = Req(0, 0, 0, (1, 2, 3), 1, (), 0, arrival_s=0.0)
    req.scheduled_s = req.read_start_s = req.read_done_s = req.prefill_start_s = 1.0
    req.first_token_s = 2.0
    req.stamp_done(second_token_s=2.5, finish_s=3.0)  # the DE's clock read after the first
    rec = req.record()
    assert rec.second_token_s == 2.0 and rec.finish_s == 3.0


def test_hbm_pool_tables_round_trip_and_reuse_pages() -> None:
    import torch

    from dualpath.runtime.hbm import HbmPool

    pool = HbmPool(6, 4, 2, 8)
    table = pool.alloc(3)
    assert table == [0, 1, 2] and pool.alloc(4) is None  # lowest pages first; no overcommit
    kv = torch.arange(10 * 2 * 2 * 8, dtype=torch.float32).view(10, 2, 2, 8)
    pool.scatter(table, 0, kv[:5])
    pool.scatter(table, 5, kv[5:])  # across a page boundary
    assert torch.equal(pool.gather(table, 10), kv)
    pool.free(table)
    assert pool.num_free == 6 and pool.alloc(1) == [0]
    with pytest.raises(ValueError, match="can never fit"):
        pool.alloc_wait(7, timeout_s=0.01)
