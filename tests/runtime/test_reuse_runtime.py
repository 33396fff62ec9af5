"""The reuse designs our runtime carries out (docs/peers.md), on the tiny model in real
processes: the same tokens as recomputing, the hits from where the design finds them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.session import Runtime
from dualpath.workload.scripts import AgentScript, agent_scripts, small_trajectories

from .conftest import assert_no_processes, reference_outputs, small_config

pytestmark = [pytest.mark.slow, pytest.mark.runtime]


def _agents(num_agents: int, num_turns: int) -> list[AgentScript]:
    cfg = small_config()
    wl = replace(cfg.workload, num_agents=num_agents, seed=0)
    trajs = small_trajectories(wl, 64, num_turns=num_turns, token_scale=0.15, max_gen_tokens=6)
    return agent_scripts(trajs, cfg.model.vocab_size, 0)


def test_dram_tier_serves_hits_from_dram_with_the_same_tokens(tmp_path: Path) -> None:
    cfg = small_config()
    agents = _agents(3, 4)
    want = reference_outputs(cfg, agents)
    opts = RuntimeOptions(system="dram-tier", kv_root=str(tmp_path))
    with Runtime(cfg, opts) as rt:
        result = rt.run(agents)
        pids = rt.pids()
    assert_no_processes(pids)
    assert result.outputs == want
    paths = result.bytes_by_path
    full = cfg.model.num_layers * 64 * cfg.model.kv_bytes_per_token_per_layer
    hits = sum(r.hit_tokens for r in result.records) // 64 * full
    assert hits > 0
    tier, storage = paths.get("pe_dram_to_pe_hbm", 0), paths["storage_to_pe_buffer"]
    assert tier + storage == hits  # every hit block came from one of the two, once
    # a turn's hits are its previous prompt (kept when computed) and its previous output
    # (read once from storage): most come from DRAM
    assert tier > 2 * storage


def test_d2p_pulls_the_previous_turn_from_its_de_with_the_same_tokens(tmp_path: Path) -> None:
    cfg = small_config()
    agents = _agents(3, 4)
    want = reference_outputs(cfg, agents)
    with Runtime(cfg, RuntimeOptions(system="d2p", kv_root=str(tmp_path))) as rt:
        result = rt.run(agents)
        sched = rt.scheduler
        assert sched.holds is not None and len(sched.holds) == 3  # each agent's last turn
        pids = rt.pids()
    assert_no_processes(pids)
    assert result.outputs == want
    paths = result.bytes_by_path
    full = cfg.model.num_layers * 64 * cfg.model.kv_bytes_per_token_per_layer
    hits = sum(r.hit_tokens for r in result.records) // 64 * full
    assert hits > 0
    # every hit comes from the DE that decoded the agent's previous turn: none from storage
    assert paths["storage_to_pe_buffer"] == 0 and paths["storage_to_de_buffer"] == 0
    assert paths["peer_to_pe_hbm"] == hits


def test_d2p_holds_that_expire_are_released_and_read_from_storage(tmp_path: Path) -> None:
    cfg = small_config().with_overrides("reuse.d2p_ttl_s=1e-6")  # gone before the next turn
    agents = _agents(2, 3)
    want = reference_outputs(cfg, agents)
    with Runtime(cfg, RuntimeOptions(system="d2p", kv_root=str(tmp_path))) as rt:
        result = rt.run(agents)
        sched = rt.scheduler
        free = dict(sched.pools.free_pages)
        residency = sched.core.residency
        assert residency is not None
        expired = residency.expired_tokens()
        pids = rt.pids()
    assert_no_processes(pids)
    assert result.outputs == want
    assert result.bytes_by_path.get("peer_to_pe_hbm", 0) == 0
    assert result.bytes_by_path["storage_to_pe_buffer"] > 0
    assert expired > 0
    # the released pages came back: only the last turns' holds may still take DE pages
    de_pages = sched.pools.hbm_pages
    held = sum(de_pages - free[e] for e in sched.topo.de_ids)
    assert held <= len(agents) * de_pages // 4


def test_the_runtime_refuses_what_it_does_not_carry_out(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="system='d2p-evictable' runs only in the simulator"):
        RuntimeOptions(system="d2p-evictable", kv_root=str(tmp_path))
    cfg = small_config().with_overrides("reuse.dram_tier_peer_pull=true")
    with pytest.raises(ValueError, match="dram_tier_peer_pull=true is not supported"):
        Runtime(cfg, RuntimeOptions(system="dram-tier", kv_root=str(tmp_path)))
