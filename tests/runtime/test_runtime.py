"""A real multi-process 1P1D run on the tiny model: both load paths, restart, faults."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.kv.store import BlockLayout, KVStore, block_keys
from dualpath.runtime.env import kv_namespace
from dualpath.runtime.launcher import RuntimeFailure
from dualpath.runtime.options import FaultPlan, RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.session import Runtime
from dualpath.types import TrafficClass
from dualpath.workload import persisted_tokens
from dualpath.workload.scripts import AgentScript, agent_scripts, small_trajectories

from .conftest import assert_no_processes, reference_outputs, replay_ledger_log, small_config

pytestmark = [pytest.mark.slow, pytest.mark.runtime]


def _agents(num_agents: int, num_turns: int, seed: int = 0) -> list[AgentScript]:
    cfg = small_config()
    wl = replace(cfg.workload, num_agents=num_agents, seed=seed)
    trajs = small_trajectories(wl, 64, num_turns=num_turns, token_scale=0.15, max_gen_tokens=6)
    return agent_scripts(trajs, cfg.model.vocab_size, seed)


def test_both_paths_restart_and_corruption_give_recompute_tokens(tmp_path: Path) -> None:
    cfg = small_config()
    agents = _agents(3, 3)
    want = reference_outputs(cfg, agents)
    opts = RuntimeOptions(system="dpl", kv_root=str(tmp_path))  # alternates PE / DE reads
    with Runtime(cfg, opts) as rt:
        first = rt.run(agents)
        pids = rt.pids()
        sched = rt.scheduler
        with pytest.raises(ValueError, match="unknown agent"):
            sched.submit_turn(99, (1, 2), 1)
        with pytest.raises(ValueError, match="empty prompt"):
            sched.submit_turn(0, (), 1)
        with pytest.raises(ValueError, match="context limit"):
            sched.submit_turn(0, (1,) * cfg.model.max_context_tokens, 1)
    assert_no_processes(pids)
    assert first.outputs == want
    prev = {(r.agent_id, r.turn_index): r for r in first.records}
    for r in first.records:  # hits are exactly what the previous turn persisted (design §3, §9)
        before = prev.get((r.agent_id, r.turn_index - 1))
        done = persisted_tokens(before.prompt_tokens + before.output_tokens, 64) if before else 0
        assert r.hit_tokens == min(done, (r.prompt_tokens - 1) // 64 * 64)
    sides = {r.read_side for r in first.records if r.hit_tokens}
    assert sides == {"pe", "de"}  # both load paths carried hit KV
    assert (
        first.bytes_by_path["storage_to_pe_buffer"] > 0
        and first.bytes_by_path["storage_to_de_buffer"] > 0
    )
    # damage the store: flip a byte of agent 0's first block, delete agent 1's second block
    ns = kv_namespace(cfg, opts.weight_seed)
    store = KVStore(
        tmp_path,
        BlockLayout(cfg.model.num_layers, 64, cfg.model.kv_bytes_per_token_per_layer),
        namespace=ns,
    )
    corrupt = block_keys(agents[0].appends[0], 64, ns)[0]
    missing = block_keys(agents[1].appends[0], 64, ns)[1]
    raw = bytearray(store.path(corrupt).read_bytes())
    raw[-1] ^= 0xFF
    store.path(corrupt).write_bytes(bytes(raw))
    store.path(missing).unlink()
    with Runtime(cfg, replace(opts, system="basic")) as rt:  # restart: store persisted
        again = rt.run(agents)
    assert again.outputs == want  # damaged blocks were recomputed, never used
    by_turn = {(r.agent_id, r.turn_index): r for r in again.records}
    assert by_turn[(0, 0)].hit_tokens == 0  # corrupt first block: nothing usable
    assert by_turn[(1, 0)].hit_tokens == 64  # chain stops at the missing second block
    assert by_turn[(2, 0)].hit_tokens > 0  # a restart finds the first run's blocks
    out = memoryview(bytearray(store.layout.full_block_bytes))
    store.read_block(corrupt, out)  # recomputed and persisted again, now valid
    store.read_block(missing, out)
    assert all(r.read_side in ("pe", "none") for r in again.records)


@pytest.mark.parametrize("crash_engine", [0, 2], ids=["pe", "de"])
def test_dead_engine_requests_are_requeued_and_complete(tmp_path: Path, crash_engine: int) -> None:
    cfg = small_config(gpus_per_node=2)  # the default shape: 2 engines per node
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, compute_quota_s=0.01))  # forces chunks
    agents = _agents(3, 2, seed=1)
    want = reference_outputs(cfg, agents)
    faults = FaultPlan(crash_engine=crash_engine, crash_at_message=1)
    log = tmp_path / "ledger.jsonl"
    opts = RuntimeOptions(kv_root=str(tmp_path), faults=faults, pe_hbm_tokens=1024)  # paged
    with Runtime(cfg, opts) as rt:
        assert rt.scheduler.topo.kind_of(crash_engine).value == ("pe" if crash_engine < 2 else "de")
        rt.scheduler.record_ledger(str(log))
        result = rt.run(agents)
        pids = rt.pids()
        resolved = rt.config
    assert_no_processes(pids)
    assert result.requeued >= 1
    assert result.outputs == want  # batched, chunked, paged, requeued: recompute's tokens
    assert result.chunked > 0 and result.mean_batch > 1.0
    assert len(result.records) == 6  # every turn finished exactly once
    assert replay_ledger_log(resolved, log) >= 6 + result.requeued  # same decisions on replay


@pytest.mark.parametrize("system", ["dualpath", "basic"])
def test_batched_chunked_paged_passes_give_recompute_tokens(tmp_path: Path, system: str) -> None:
    cfg = small_config()  # one PE, one DE: every request shares their batches
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, compute_quota_s=0.01))  # forces chunks
    agents = _agents(6, 2, seed=4)
    want = reference_outputs(cfg, agents)
    hbm_tokens = 2048  # a small paged HBM: Basic's batches are capped by it
    log = tmp_path / "ledger.jsonl"
    opts = RuntimeOptions(system=system, kv_root=str(tmp_path), hbm_tokens=hbm_tokens)
    with Runtime(cfg, opts) as rt:
        rt.scheduler.record_ledger(str(log))
        result = rt.run(agents)
        resolved = rt.config
        free = dict(rt.scheduler.free_pages)
    assert result.outputs == want  # batched, chunked, paged: same tokens as recompute
    if system == "dualpath":  # under the compute quota (Basic has none, design §13.7)
        assert result.mean_batch > 1.0  # passes packed several requests
        assert result.chunked > 0  # some requests took several passes (KV kept across them)
    assert '"op": "plan"' in log.read_text()
    assert replay_ledger_log(resolved, log) >= 12 + result.forward_chunks
    assert set(free.values()) == {hbm_tokens // 64 * cfg.model.num_layers}  # all pages back
    if system == "basic":  # every layer of the batch resident: never over the HBM pool
        assert result.max_pass_tokens <= hbm_tokens


def test_turns_submitted_from_another_thread_stream_their_tokens(tmp_path: Path) -> None:
    import threading

    cfg = small_config()
    script = _agents(2, 1, seed=5)
    want = reference_outputs(cfg, script)
    seen: dict[int, list[tuple[tuple[int, ...], bool]]] = {}
    with Runtime(cfg, RuntimeOptions(kv_root=str(tmp_path))) as rt:
        sched = rt.scheduler
        futures = []

        def submit() -> None:  # a server thread: agents unknown to the run loop so far
            for a in script:
                dyn = AgentState(a.agent_id, (), ())
                cb = lambda rid, toks, done: seen.setdefault(rid, []).append((toks, done))  # noqa: E731
                futures.append(sched.submit_threadsafe(dyn, a.appends[0], a.outputs[0], cb))
            futures.append(sched.submit_threadsafe(AgentState(9, (), ()), (), 1))

        thread = threading.Thread(target=submit)
        thread.start()
        thread.join()
        sched.run()
    rids = [f.result(timeout=1) for f in futures[:2]]
    with pytest.raises(ValueError, match="empty prompt append"):
        futures[2].result(timeout=1)
    for a, rid in zip(script, rids, strict=True):
        events = seen[rid]
        assert events[-1] == (want[a.agent_id][0], True)  # equal to recompute
        assert events[0] == ((want[a.agent_id][0][0],), False)  # first token streamed first


def test_full_de_buffer_applies_backpressure_without_loss(tmp_path: Path) -> None:
    cfg = small_config()
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, compute_quota_s=0.01))  # forces chunks
    agents = _agents(3, 2, seed=2)
    want = reference_outputs(cfg, agents)
    longest = max(len(a.appends[0]) + len(a.appends[1]) + a.outputs[0] for a in agents)
    slots = -(-longest // 64) + 1  # room for one request at a time plus one persist slot
    opts = RuntimeOptions(kv_root=str(tmp_path), buffer_slots=slots, hbm_tokens=2048)  # paged
    with Runtime(cfg, opts) as rt:
        result = rt.run(agents)
    assert result.outputs == want  # chunked and paged under backpressure: recompute's tokens
    assert result.chunked > 0
    assert len(result.records) == 6
    assert result.alloc_stalls > 0  # requests waited for DE buffer space


def test_failure_inside_the_run_stops_every_process(tmp_path: Path) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        Runtime(small_config(), RuntimeOptions(kv_root=str(tmp_path))) as rt,
    ):
        pids = rt.pids()
        raise KeyboardInterrupt
    assert_no_processes(pids)


def test_an_unwritable_kv_root_fails_before_any_process_starts(tmp_path: Path) -> None:
    root = tmp_path / "not-a-directory"
    root.write_text("x")  # the KV root cannot be written: the run fails before it starts
    rt = Runtime(small_config(), RuntimeOptions(kv_root=str(root)))
    with pytest.raises(RuntimeFailure, match="not a writable directory"):
        rt.__enter__()
    assert rt.pids() == []  # no process was started


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="system='fast'"):
        RuntimeOptions(system="fast")
    with pytest.raises(ValueError, match="transport='rdma'"):
        RuntimeOptions(transport="rdma")
    with pytest.raises(ValueError, match="hbm_tokens=0"):
        RuntimeOptions(hbm_tokens=0)
    cfg = small_config()
    split = replace(cfg, scheduler=replace(cfg.scheduler, split_reads=True))
    with pytest.raises(ValueError, match="split_reads=true is not supported by the runtime"):
        Runtime(split, RuntimeOptions())


@pytest.mark.mooncake
def test_mooncake_transport_moves_the_kv(tmp_path: Path) -> None:
    try:
        from dualpath.kv.transport.mooncake import load_engine_class

        load_engine_class()
    except ImportError as err:
        pytest.skip(f"Mooncake Transfer Engine not importable: {err}")
    cfg = small_config()
    agents = _agents(2, 2, seed=3)
    want = reference_outputs(cfg, agents)
    opts = RuntimeOptions(system="dpl", kv_root=str(tmp_path), transport="mooncake")
    with Runtime(cfg, opts) as rt:
        result = rt.run(agents)
        pids = rt.pids()
    assert_no_processes(pids)
    assert result.outputs == want
    assert result.bytes_by_path["pe_hbm_to_de_buffer"] > 0


def test_server_mode_streams_each_step_samples_on_the_engines_and_cancels(
    tmp_path: Path,
) -> None:
    import threading
    import time

    from dualpath.runtime.sampling import SamplingParams

    cfg = small_config()
    script = _agents(1, 1, seed=7)[0]
    prompt, n = script.appends[0], 8
    want = reference_outputs(cfg, [AgentScript(0, (prompt,), (n,))])[0][0]
    seen: dict[int, list[tuple[tuple[int, ...], bool]]] = {}

    def cb(rid: int, toks: tuple[int, ...], done: bool) -> None:
        seen.setdefault(rid, []).append((toks, done))

    opts = RuntimeOptions(kv_root=str(tmp_path), hbm_tokens=4096)
    stop = threading.Event()
    with Runtime(cfg, opts) as rt:
        sched = rt.scheduler
        loop = threading.Thread(target=sched.run, args=(stop,))
        loop.start()

        def submit(out: int, sampling: SamplingParams | None = None, agent: int = 0) -> int:
            fut = sched.submit_threadsafe(AgentState(agent, (), ()), prompt, out, cb, sampling)
            return fut.result(timeout=60)

        def wait_done(rid: int) -> tuple[int, ...]:
            deadline = time.monotonic() + 120
            while not (seen.get(rid) and seen[rid][-1][1]) and time.monotonic() < deadline:
                time.sleep(0.02)
            return seen[rid][-1][0]

        greedy = submit(n, agent=1)
        assert wait_done(greedy) == want  # equal to recompute
        # one event per decode step: tokens so far grow by one, then the final one
        assert [len(t) for t, _ in seen[greedy]] == [*range(1, n + 1), n]
        hot = SamplingParams(temperature=1.0, top_p=0.95, seed=3)
        a, b = submit(n, hot, agent=2), submit(n, hot, agent=3)
        assert wait_done(a) == wait_done(b) != want  # seeded on the engines
        eos = SamplingParams(stop_token_ids=(want[3],))
        cut = want[: want.index(want[3]) + 1]
        assert wait_done(submit(n, eos, agent=4)) == cut  # the DE ends at a stop token
        long = submit(3000, agent=5)
        while len(seen.get(long, [])) < 3:
            time.sleep(0.01)
        sched.cancel_threadsafe(long)
        deadline = time.monotonic() + 60
        full = sched.hbm_pages
        while time.monotonic() < deadline and set(sched.free_pages.values()) != {full}:
            time.sleep(0.05)
        assert set(sched.free_pages.values()) == {full}  # the DE dropped it: HBM back
        assert not any(done for _, done in seen[long])
        assert sched.num_cancelled == 1
        stop.set()
        loop.join(timeout=30)
        assert not loop.is_alive()
        pids = rt.pids()
    assert_no_processes(pids)


def test_group_pes_exchange_states_and_transfers_charge_both_cnics(tmp_path: Path) -> None:
    cfg = small_config(gpus_per_node=2)  # PEs 0, 1 form a group; DEs 2, 3 on node 1
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, compute_quota_s=0.01))  # forces chunks
    agents = _agents(4, 2, seed=5)
    want = reference_outputs(cfg, agents)
    opts = RuntimeOptions(kv_root=str(tmp_path), transfer_window=2, pe_hbm_tokens=1024)
    with Runtime(cfg, opts) as rt:
        result = rt.run(agents)
        links = rt.launcher.link_stats()
        free = dict(rt.scheduler.free_pages)
    # batched, chunked, paged (a small PE pool), both load paths, the exchange, a window of 2:
    # the same tokens as recompute
    assert result.outputs == want
    assert result.chunked > 0 and result.mean_batch > 1.0
    assert {r.read_side for r in result.records if r.hit_tokens} == {"pe", "de"}
    assert free[0] == free[1] == 1024 // 64 * cfg.model.num_layers  # every PE page back
    high, low = TrafficClass.HIGH, TrafficClass.LOW
    row = cfg.model.hidden_size * 4 * cfg.model.num_layers
    sent = [links[f"pe{e}@node0.tx"].bytes_by_class[high] for e in (0, 1)]
    got = [links[f"pe{e}@node0.rx"].bytes_by_class[high] for e in (0, 1)]
    assert sent[0] > 0 and sent[1] > 0  # the PEs exchanged hidden states (real all-gather)
    assert sent == got[::-1]  # each send charged on the sender's tx and the peer's rx
    assert sent[0] % row == 0 and sent[1] % row == 0  # whole tokens × every layer
    paths = result.bytes_by_path

    def total(names: list[str], klass: TrafficClass = low) -> int:
        return sum(links[n].bytes_by_class[klass] for n in names)

    pe_tx, pe_rx = ["pe0@node0.tx", "pe1@node0.tx"], ["pe0@node0.rx", "pe1@node0.rx"]
    de_tx, de_rx = ["de2@node1.tx", "de3@node1.tx"], ["de2@node1.rx", "de3@node1.rx"]
    assert paths["pe_hbm_to_de_buffer"] > 0 and paths["de_to_storage"] > 0
    assert total(pe_rx) == paths["buffer_to_pe_hbm"]  # every Layer Block load
    # the DE node's CNICs carry the PEs' sends too (both ends charged), plus the DEs'
    # loopback H2D and persist copies (both directions of their own CNIC)
    assert (
        total(de_rx)
        == paths["pe_hbm_to_de_buffer"] + paths["de_buffer_to_de_hbm"] + paths["de_to_storage"]
    )
    # every byte left through one tx: a PE's (its sends, loopback loads from the PE buffer)
    # or a DE's (loads from the DE buffer, loopback H2D and persist copies)
    sent = sum(paths[k] for k in ("pe_hbm_to_de_buffer", "buffer_to_pe_hbm", "de_buffer_to_de_hbm"))
    sent += paths["de_to_storage"]
    assert total(pe_tx) + total(de_tx) == sent
    assert total(de_tx) > paths["de_to_storage"]  # the DE read path carried layer loads
    assert links["dram@node1"].bytes_by_class[low] >= total(de_rx)  # DRAM paced per node
    assert links["dram@node0"].bytes_by_class[low] > 0


def test_a_prompt_of_whole_blocks_sent_again_recomputes_its_last_block(tmp_path: Path) -> None:
    """A prompt of exactly k Full Blocks, sent a second time, hits only k − 1 of them: the
    PE needs at least one new token to produce the first one (the hit cap in
    ``Intake.submit``); the answer is the recompute's."""
    import threading
    import time

    cfg = small_config()
    block = cfg.scheduler.block_tokens
    prompt = tuple((7 * i + 3) % cfg.model.vocab_size for i in range(2 * block))
    want = reference_outputs(cfg, [AgentScript(0, (prompt,), (4,))])[0][0]
    done: dict[int, tuple[int, ...]] = {}

    def cb(rid: int, toks: tuple[int, ...], last: bool) -> None:
        if last:
            done[rid] = toks

    stop = threading.Event()
    with Runtime(cfg, RuntimeOptions(kv_root=str(tmp_path))) as rt:
        sched = rt.scheduler
        loop = threading.Thread(target=sched.run, args=(stop,))
        loop.start()
        try:
            for agent in (1, 2):  # two conversations, one prompt: the second hits the first's
                rid = sched.submit_threadsafe(AgentState(agent, (), ()), prompt, 4, cb)
                rid_value = rid.result(timeout=60)
                deadline = time.monotonic() + 120
                while rid_value not in done and time.monotonic() < deadline and loop.is_alive():
                    time.sleep(0.02)
                assert done.get(rid_value) == want
        finally:
            stop.set()
            loop.join(timeout=30)
        assert not loop.is_alive()
        hits = [r.hit_tokens for r in sched.records]
        pids = rt.pids()
    assert hits == [0, block]  # the second: every block but the last
    assert_no_processes(pids)
