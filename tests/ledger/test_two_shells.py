"""Two shells, one core: the runtime and the simulator drive the same ledger and policy.

Both shells run the same small workload and write their ledger journals (the runtime as JSON
lines). Each journal must (1) replay through a fresh ledger and policy to the same views,
assignments and forward plans; (2) agree at every pull with an independent recount of design
§13.4's counters from the journal's turn events (written here, not with the ledger), so a
shell that misreports a turn or a ledger that miscounts fails; (3) describe the same turns
(prompt, hit, output per agent turn) moving through the same phases in both shells.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dualpath.config import Config, apply_overrides, preset
from dualpath.config.sim import SimConfig
from dualpath.config.systems import system_spec
from dualpath.ledger import (
    ForwardDone,
    ForwardStarted,
    ReplayMismatch,
    Topology,
    TurnDone,
    replay,
)
from dualpath.policy import make_policy
from dualpath.sim.cluster import Cluster
from dualpath.sim.runner import run_cluster
from dualpath.workload import Trajectory, turn_requests

SYSTEM = "dualpath"
RUNTIME_ONLY_OPS = {"loaded", "free_hbm", "generated"}  # reports only the runtime's engines make


def _config() -> Config:
    cfg = preset("tiny-1p1d")
    return replace(cfg, hardware=replace(cfg.hardware, gpus_per_node=2))  # 2 PEs, 2 DEs


def _trajectories(cfg: Config) -> list[Trajectory]:
    from dualpath.workload.scripts import small_trajectories

    # outputs long enough that later pulls find DEs mid-decode (the runtime journals a
    # "generated" op only at a pull after a DE stepped; with 6 tokens a loaded host could
    # finish every decode between two pulls)
    wl = replace(cfg.workload, num_agents=4, seed=3)
    return small_trajectories(
        wl, cfg.scheduler.block_tokens, 3, token_scale=0.15, max_gen_tokens=16
    )


def _runtime_journal(cfg: Config, trajs: list[Trajectory], tmp: Path) -> tuple[list[Any], Config]:
    pytest.importorskip("torch")  # the runtime's engines (the simulator's tests need none)
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.runtime.session import Runtime
    from dualpath.workload.scripts import agent_scripts

    log = tmp / "ledger.jsonl"
    opts = RuntimeOptions(system=SYSTEM, kv_root=str(tmp / "kv"))
    seen: dict[type, list[Any]] = defaultdict(list)
    with Runtime(cfg, opts) as rt:
        rt.scheduler.record_ledger(str(log))
        for kind in (TurnDone, ForwardStarted, ForwardDone):  # as observers do in the simulator
            rt.scheduler.events.subscribe(kind, seen[kind].append)
        result = rt.run(agent_scripts(trajs, cfg.model.vocab_size, 0))
        resolved = rt.config
    assert len(result.records) == sum(len(t.turns) for t in trajs)
    by_id = sorted((ev.record for ev in seen[TurnDone]), key=lambda r: r.request_id)
    assert by_id == list(result.records)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # every plan belongs to one group pass, announced (with its PEs' plans) and ended once
    plans = [
        (r["pe"], tuple((c[1], c[2]) for c in r["chunks"])) for r in records if r["op"] == "plan"
    ]
    assert [b for ev in seen[ForwardStarted] for b in ev.batches] == plans
    ended = Counter(ev.batches for ev in seen[ForwardDone])
    assert ended == Counter(ev.batches for ev in seen[ForwardStarted])
    return records, resolved


def _sim_journal(cfg: Config, trajs: list[Trajectory]) -> tuple[list[Any], Config]:
    cluster = Cluster(cfg, system_spec(SYSTEM), SimConfig())
    records: list[Any] = []
    cluster.core.start_journal(records.append)
    for traj in trajs:
        cluster.add_agent(traj.agent_id, turn_requests(traj, cfg.scheduler.block_tokens), 0.0)
    run_cluster(cluster)
    assert cluster.num_turns_done == cluster.num_turns_total
    # a JSON round trip, as the runtime's log takes
    return [json.loads(json.dumps(r)) for r in records], cluster.config


def recount(
    records: list[Any], topo: Topology
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """At every pull: (record index, the view recounted from the turn events so far, the
    recorded view). Counts from scratch, per design §13.4: seq_e / tok_e of the turns on an
    engine (a PE until token 1, a DE until the turn ends; a DE's tok_e adds the tokens its
    group reported generated), free HBM (reported, or capacity) less the turns reserved on
    a DE (until loaded, or until done), read_q / bytes read per node."""
    init = records[0]
    capacity = init["hbm_capacity_tokens"]
    reported = {e: t for e, t in enumerate(init["free_hbm"] or ()) if t >= 0}
    turns: dict[int, dict[str, Any]] = {}
    generated: dict[int, int] = defaultdict(int)
    bytes_read: dict[int, float] = defaultdict(float)
    for i, rec in enumerate(records[1:], start=1):
        op = rec["op"]
        if op == "submit":
            turns[rec["id"]] = {"prompt": rec["prompt"], "output": rec["output"], "state": "queued"}
        elif op == "assign":
            rid, pe, de, _side, pe_tokens, de_tokens = rec["a"]
            reads = {"pe": pe_tokens, "de": de_tokens} if rec["read"] else {}
            reads = {k: v for k, v in reads.items() if v > 0}
            turns[rid].update(pe=pe, de=de, reads=reads, state="on_pe", loaded=False)
        elif op == "read_started":
            bytes_read[rec["node"]] += rec["bytes"]
        elif op == "read_done":
            t = turns[rec["id"]]  # the read on the node of the read side's engine is done
            del t["reads"]["pe" if topo.node_of(t["pe"]) == rec["node"] else "de"]
        elif op == "first_token":
            turns[rec["id"]]["state"] = "on_de"
        elif op == "loaded":
            turns[rec["id"]]["loaded"] = True
        elif op in ("finish", "abort"):
            turns[rec["id"]]["state"] = "gone"
        elif op == "free_hbm":
            reported[rec["engine"]] = rec["tokens"]
        elif op == "generated":
            for e, g in zip(rec["members"], rec["values"], strict=True):
                generated[e] = g
        elif op == "pull":
            recorded = rec["view"]
            engines = [[0, 0, 0] for _ in recorded["engines"]]
            nodes = [[0, bytes_read[n]] for n in range(len(recorded["nodes"]))]
            des = set()
            for t in turns.values():
                if t["state"] in ("queued", "gone"):
                    continue
                des.add(t["de"])
                if t["state"] == "on_pe":
                    engines[t["pe"]][0] += 1
                    engines[t["pe"]][1] += t["prompt"]
                engines[t["de"]][0] += 1
                engines[t["de"]][1] += t["prompt"]
                if not t["loaded"]:
                    engines[t["de"]][2] -= t["prompt"] + t["output"]
                for side, tokens in t["reads"].items():
                    nodes[topo.node_of(t[side])][0] += tokens
            for e, row in enumerate(engines):
                if not topo.is_pe(e):
                    row[1] += generated[e] if row[0] else 0
                    row[2] = max(0, reported.get(e, capacity) + row[2])
                else:
                    row[2] = reported.get(e, 0)
            yield i, {"engines": engines, "nodes": nodes}, recorded
            for e in des:  # a DE's generated tokens belong to its resident turns only
                outputs = sum(
                    t["output"]
                    for t in turns.values()
                    if t.get("de") == e and t["state"] == "on_de"
                )
                loaded = sum(
                    1
                    for t in turns.values()
                    if t.get("de") == e and t["state"] == "on_de" and t["loaded"]
                )
                assert loaded <= generated[e] <= outputs, (i, e, generated[e], loaded, outputs)


def _lifecycles(records: list[Any]) -> dict[tuple[int, int], tuple[Any, ...]]:
    """(agent, turn) → (prompt, hit, output, the ops reported for it, shell-only ops left out)."""
    by_id: dict[int, tuple[int, int]] = {}
    out: dict[tuple[int, int], list[Any]] = {}
    for rec in records[1:]:
        if rec["op"] == "submit":
            key = (rec["agent"], rec["turn"])
            by_id[rec["id"]] = key
            out[key] = [rec["prompt"], rec["hit"], rec["output"]]
        rid = rec["a"][0] if rec["op"] == "assign" else rec.get("id")
        if rid is not None and rec["op"] != "submit" and rec["op"] not in RUNTIME_ONLY_OPS:
            out[by_id[rid]].append(rec["op"])
    return {k: tuple(v) for k, v in out.items()}


def _check(records: list[Any], config: Config) -> None:
    stats = replay(records, Topology.from_config(config), make_policy(config))
    assert stats.assignments == sum(1 for r in records if r["op"] == "submit")
    assert stats.plans > 0 and stats.chunks >= stats.assignments
    pulls = 0
    for i, expected, recorded in recount(records, Topology.from_config(config)):
        assert expected == recorded, f"record {i}: recounted {expected} != ledger's {recorded}"
        pulls += 1
    assert pulls == stats.pulls


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_runtime_and_simulator_drive_one_ledger(tmp_path: Path) -> None:
    cfg = _config()
    trajs = _trajectories(cfg)
    rt_records, rt_config = _runtime_journal(cfg, trajs, tmp_path)
    sim_records, sim_config = _sim_journal(cfg, trajs)
    _check(rt_records, rt_config)
    _check(sim_records, sim_config)
    # the runtime reports its engines' HBM and decode progress; the simulator models them
    assert {r["op"] for r in rt_records} >= RUNTIME_ONLY_OPS
    assert not {r["op"] for r in sim_records} & {"loaded", "free_hbm"}
    assert any(r["op"] == "generated" and any(r["values"]) for r in rt_records)
    # the same turns, hits and outputs, through the same phases
    rt_life, sim_life = _lifecycles(rt_records), _lifecycles(sim_records)
    assert rt_life == sim_life
    assert any(life[1] > 0 for life in rt_life.values())  # later turns hit stored KV
    # both start from the same state: the first pull sees the same queue and decides alike
    # (free HBM differs: the runtime's engines report their pools, the simulator has the cost
    # model's capacity, so compare the decisions, not the views)
    first = [next(r for r in recs if r["op"] == "pull") for recs in (rt_records, sim_records)]
    assert first[0]["assigns"] == first[1]["assigns"]


def test_replay_fails_on_a_decision_the_policy_would_not_make() -> None:
    cfg = _config()
    records, config = _sim_journal(cfg, _trajectories(cfg))
    i = next(i for i, r in enumerate(records) if r["op"] == "pull" and r["assigns"])
    a = records[i]["assigns"][0]
    a[2] = 5 - a[2]  # the other DE (engines 2 and 3)
    with pytest.raises(ReplayMismatch, match="assigns"):
        replay(records, Topology.from_config(config), make_policy(config))


def test_recount_fails_on_a_misreported_turn() -> None:
    """A shell that forgets to report a turn's first token keeps it on its PE: the recount
    of design §13.4 then differs from the ledger's view (here: the journal is edited)."""
    cfg = _config()
    records, config = _sim_journal(cfg, _trajectories(cfg))
    i = next(i for i, r in enumerate(records) if r["op"] == "first_token")
    del records[i]
    with pytest.raises(AssertionError):
        for _, expected, recorded in recount(records, Topology.from_config(config)):
            assert expected == recorded


def test_a_median_balanced_journal_replays_with_its_caps() -> None:
    """``scheduler.pass_balance=median``: the simulator's group plans go through
    ``Ledger.plan_group``; a capped plan is journalled with its cap and replays."""
    cfg = apply_overrides(_config(), ["scheduler.pass_balance=median"])
    records, config = _sim_journal(cfg, _trajectories(cfg))
    _check(records, config)
    capped = [r for r in records if r["op"] == "plan" and "cap" in r]
    assert capped, "no pass of the 2-PE group was capped"
    for r in capped:
        r["cap"] = r["cap"] * 1e6  # a cap above the quota: the recorded chunking does not follow
    with pytest.raises(ReplayMismatch, match="plan"):
        replay(records, Topology.from_config(config), make_policy(config))
