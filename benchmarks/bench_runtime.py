"""The real runtime on the tiny model: batching, paged HBM, and storage-bound DualPath / Basic.

Run: .venv/bin/python benchmarks/bench_runtime.py [--parts batch,hbm,jct] [--agents 16 ...]

- ``batch``: N requests submitted together (no hits, Oracle: KV traffic unpaced, so compute
  binds), run once one-at-a-time (``RuntimeOptions.batching=False``: one request per PE pass
  and per DE decode batch) and once batched. Prefill tokens/s = tokens computed by the PE's
  passes / Σ pass durations (engine-measured); decode tokens/s = tokens decoded after the
  first / (last finish − first first token). Both runs go through the same code path.
- ``hbm``: Basic vs +Layer (``layer``) under a small HBM pool, many agents starting together
  so that requests queue at the PE: tokens per pass (from the forward plans) and prefill
  throughput.
- ``window``: Oracle (unpaced), one request per pass, cached prefixes: prefill speed with
  ``--windows`` transfers outstanding per engine thread, per ``--transport``.
- ``jct``: storage-bound 1P1D on preset ``tiny-testbed``, the agentic workload (design §9,
  scaled down), each system on a fresh KV store; ideal DualPath/Basic JCT ratio (P+D)/P = 2.
  The preset's SNIC (10 MB/s per node, ``--snic-mb-per-s``) is slow enough that the SNICs
  bind, and its emulated GPU (``--gpu-time emulated``, the default) slower than the host, so
  that what the host's other jobs take does not move the JCT: the table prints each node's
  SNIC read busy time, its processes' CPU use (both as a share of the JCT) and each engine's
  share of passes that overran their emulated time, so each run shows what bound it.
  ``--gpu-time emulated,host`` and ``--background-load 0,2`` (busy-loop processes started
  beside the run) give every combination in one invocation.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dualpath.cli.background import background_load, load_average
from dualpath.config import Config, preset
from dualpath.runtime.env import HEARTBEAT_S
from dualpath.runtime.options import RuntimeOptions
from dualpath.runtime.requests import AgentState
from dualpath.runtime.result import RunResult
from dualpath.runtime.session import Runtime


def _run(cfg: Config, opts: RuntimeOptions, agents: list[AgentState], kv_root: str) -> RunResult:
    Path(kv_root).mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"bench-{opts.system}-", dir=kv_root)
    try:
        with Runtime(cfg, replace(opts, kv_root=root)) as rt:
            return rt.run(agents)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_cpu(
    cfg: Config, opts: RuntimeOptions, agents: list[AgentState], kv_root: str
) -> tuple[RunResult, float, float]:
    """``_run`` plus the CPU seconds the PEs and the DEs spent during the run (start-up
    excluded): an emulated GPU's busy time, which other jobs on the host do not inflate (they
    do inflate wall-clock pass durations)."""
    Path(kv_root).mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"bench-{opts.system}-", dir=kv_root)
    try:
        with Runtime(cfg, replace(opts, kv_root=root)) as rt:
            topo = rt.scheduler.topo
            pids = {
                rt.launcher.procs[topo.engine_name(e)].pid: topo.is_pe(e) for e in topo.engine_ids
            }
            before = {pid: _cpu_s(pid) for pid in pids if pid is not None}
            res = rt.run(agents)
            used = {pid: _cpu_s(pid) - t0 for pid, t0 in before.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pe = sum(c for pid, c in used.items() if pids[pid])
    return res, pe, sum(used.values()) - pe


def _run_logged(
    cfg: Config, opts: RuntimeOptions, agents: list[AgentState], kv_root: str
) -> tuple[RunResult, list[Any]]:
    """``_run`` that also returns the ledger's journal (its ``plan`` records: forward plans)."""
    Path(kv_root).mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"bench-{opts.system}-", dir=kv_root)
    try:
        with Runtime(cfg, replace(opts, kv_root=root)) as rt:
            journal: list[Any] = []
            rt.scheduler.core.start_journal(journal.append)
            return rt.run(agents), journal
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _agents(
    n: int, prompt: tuple[int, ...], outputs: tuple[int, ...], seed: int
) -> list[AgentState]:
    """``n`` agents; turn i appends ``prompt[i]`` random tokens and generates ``outputs[i]``."""
    rng = random.Random(seed)
    return [
        AgentState(a, tuple(tuple(rng.randrange(1024) for _ in range(p)) for p in prompt), outputs)
        for a in range(n)
    ]


def part_batch(cfg: Config, args: argparse.Namespace) -> None:
    print(f"\n## batching: {args.concurrent} concurrent requests, Oracle (KV unpaced), 1 PE + 1 DE")
    print(
        "| prompt | output | mode | prefill tok/s | decode tok/s | prefill tok per PE CPU-s | "
        "decode tok per DE CPU-s | mean chunks/pass | passes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for prompt in (16, 64, 512):
        agents = _agents(args.concurrent, (prompt,), (args.decode_tokens,), seed=prompt)
        rates = {}
        for batching in (False, True):
            opts = RuntimeOptions(system="oracle", batching=batching)
            fresh = [AgentState(a.agent_id, a.appends, a.outputs) for a in agents]
            res, pe_cpu, de_cpu = _run_cpu(cfg, opts, fresh, args.kv_root)
            recs = res.records
            pre = res.pass_new_tokens / res.pass_busy_s
            decoded = sum(r.output_tokens - 1 for r in recs)
            dec = decoded / (max(r.finish_s for r in recs) - min(r.first_token_s for r in recs))
            pre_cpu, dec_cpu = res.pass_new_tokens / pe_cpu, decoded / de_cpu
            rates[batching] = (pre, dec, pre_cpu, dec_cpu)
            mode = "batched" if batching else "one-at-a-time"
            print(
                f"| {prompt} | {args.decode_tokens} | {mode} | {pre:,.0f} | {dec:,.1f} | "
                f"{pre_cpu:,.0f} | {dec_cpu:,.1f} | {res.mean_batch:.2f} | "
                f"{res.forward_passes} |"
            )
        x = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
        print(
            f"| {prompt} | | **batched / one-at-a-time** | **{x[0]:.2f}x** | **{x[1]:.2f}x** | "
            f"**{x[2]:.2f}x** | **{x[3]:.2f}x** | | |"
        )


def part_hbm(cfg: Config, args: argparse.Namespace) -> None:
    """design §8's larger batch: many agents start together, so requests queue at the PE, and
    every pass is packed up to the HBM budget (Basic: all layers of the batch resident;
    +Layer: two layers)."""
    hbm, n = args.hbm_tokens, args.hbm_agents
    print(
        f"\n## Basic vs +Layer under a PE HBM pool of {hbm} tokens (all layers; DE: default): {n} agents "
        f"start together, turn 1 = {args.hbm_prompt} new tokens, turn 2 = +32 after the "
        "cached prefix; 1 PE + 1 DE, SNIC 1 GB/s"
    )
    print(
        "| system | passes | mean chunks/pass | mean tokens/pass (cached+new) | most tokens "
        "in a pass | prefill tok/s (Σ pass time) | prefill tok/s (makespan) | JCT s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    agents = _agents(n, (args.hbm_prompt, 32), (1, 1), seed=7)
    for system in ("basic", "layer"):
        fresh = [AgentState(a.agent_id, a.appends, a.outputs) for a in agents]
        opts = RuntimeOptions(system=system, pe_hbm_tokens=hbm)  # the DEs keep the default
        res, log = _run_logged(cfg, opts, fresh, args.kv_root)
        plans = [rec["chunks"] for rec in log if rec["op"] == "plan"]
        tokens = [sum(cached + new for _, cached, new, _ in chunks) for chunks in plans]
        recs = res.records
        span = max(r.first_token_s for r in recs) - min(r.arrival_s for r in recs)
        computed = sum(r.prompt_tokens - r.hit_tokens for r in recs)
        jct = max(r.finish_s for r in recs) - min(r.arrival_s for r in recs)
        print(
            f"| {system} | {len(plans)} | {res.mean_batch:.2f} | "
            f"{sum(tokens) / len(tokens):,.0f} | {max(tokens):,} | "
            f"{res.pass_new_tokens / res.pass_busy_s:,.0f} | {computed / span:,.0f} | "
            f"{jct:.1f} |"
        )


def part_window(cfg: Config, args: argparse.Namespace) -> None:
    """Transport latency vs the transfer window: Oracle (no pacing), so a pass's Layer Block
    loads wait only on the transport; turn 2 of each agent loads a 1024-token cached prefix
    (16 Layer Blocks per layer) and computes a 32-token append."""
    print(
        f"\n## transfer window: {args.concurrent} agents x 2 turns (1024 tokens, then +32 on "
        "the cached prefix), Oracle (unpaced), 1 PE + 1 DE, one request per pass"
    )
    print("| transport | window | turn-2 prefill ms mean (p50) | all passes: mean ms | JCT s |")
    print("|---|---|---|---|---|")
    agents = _agents(args.concurrent, (1024, 32), (1, 1), seed=11)
    for transport in args.transport.split(","):
        for window in (int(w) for w in args.windows.split(",")):
            fresh = [AgentState(a.agent_id, a.appends, a.outputs) for a in agents]
            opts = RuntimeOptions(
                system="oracle", transport=transport, transfer_window=window, batching=False
            )
            res = _run(cfg, opts, fresh, args.kv_root)
            recs = res.records
            jct = max(r.finish_s for r in recs) - min(r.arrival_s for r in recs)
            # turn 2: one pass that loads the cached prefix's 64 Layer Blocks, then 32 tokens
            hits = sorted(1e3 * (r.first_token_s - r.prefill_start_s) for r in recs if r.hit_tokens)
            print(
                f"| {transport} | {window} | {sum(hits) / len(hits):.1f} "
                f"({hits[len(hits) // 2]:.1f}) | "
                f"{1e3 * res.pass_busy_s / res.forward_passes:.1f} | {jct:.1f} |"
            )


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _jct_run(cfg: Config, opts: RuntimeOptions, agents: list[AgentState]) -> dict[str, Any]:
    """One system on a fresh store: its result, each node's SNIC read busy seconds (from the
    storage workers' pacers) and each node's CPU seconds (its engines + its storage worker)."""
    Path(opts.kv_root).mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"bench-{opts.system}-", dir=opts.kv_root)
    try:
        with Runtime(cfg, replace(opts, kv_root=root)) as rt:
            res = rt.run(agents)
            time.sleep(2 * HEARTBEAT_S)  # the pacers' busy time is published every heartbeat
            busy = rt.launcher.nic_busy_s()
            topo = rt.scheduler.topo
            node_of = {f"storage@node{n}": n for n in range(topo.num_nodes)}
            node_of.update({topo.engine_name(e): topo.node_of(e) for e in topo.engine_ids})
            cpu = [0.0] * topo.num_nodes
            for name, proc in rt.launcher.procs.items():
                if name in node_of and proc.pid is not None:
                    cpu[node_of[name]] += _cpu_s(proc.pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = topo.num_nodes
    return {
        "result": res,
        "read_busy_s": [busy[f"snic_node{i}_read"] for i in range(n)],
        "cpu_s": cpu,
    }


def _overruns(res: RunResult) -> str:
    """Each engine's share of passes / decode steps that overran their emulated time."""
    if not res.gpu_use:
        return "n/a"
    return ", ".join(
        f"{name.split('@')[0]} {u.overrun_share:.0%}" for name, u in res.gpu_use.items()
    )


def part_jct(cfg: Config, args: argparse.Namespace) -> None:
    """Storage-bound 1P1D (design §9's agentic workload, scaled down): every system on the same
    agents, each on a fresh KV store. The SNIC rate is low enough that every node's CPU is
    busy well under one core for most of the run (printed), so the SNICs, not the 2-core
    host, set the pace: Basic reads every hit through the prefill node's SNIC, DualPath
    through both, and the ideal speed-up is (P+D)/P = 2."""
    from dualpath.metrics import summarize
    from dualpath.workload.scripts import agent_scripts, small_trajectories

    rate = args.snic_mb_per_s * 1e6 if args.snic_mb_per_s else cfg.hardware.snic_bytes_per_s
    cfg = replace(
        cfg,
        hardware=replace(cfg.hardware, gpus_per_node=2, snic_bytes_per_s=rate),
        workload=replace(cfg.workload, num_agents=args.agents),
    )
    block = cfg.scheduler.block_tokens
    trajs = small_trajectories(cfg.workload, block, args.turns, args.token_scale, args.max_gen)
    rate_total = cfg.hardware.snic_total_bytes_per_s
    ratios = []
    for load, gpu_time, transport, window in (
        (int(n), g, t, int(w))
        for n in args.background_load.split(",")
        for g in args.gpu_time.split(",")
        for t in args.transport.split(",")
        for w in args.windows.split(",")
    ):
        with background_load(load):
            print(
                f"\n## storage-bound JCT: {cfg.name}, 1P1D, 2 engines/node, SNIC "
                f"{rate_total / 1e6:g} MB/s per node, {args.agents} agents x {args.turns} turns "
                f"(appends x {args.token_scale:g}, <= {args.max_gen} generated), transport "
                f"{transport}, transfer window {window}, GPU time {gpu_time}, background load "
                f"{load} busy loop(s); ideal DualPath/Basic speed-up (P+D)/P = 2; at start: "
                f"{load_average()}"
            )
            print(
                "| system | JCT s | TTFT mean s | TPOT mean ms | hit MB read (PE node / DE "
                "node) | SNIC read busy, % of JCT (PE node / DE node) | reads alone / JCT | "
                "CPU, cores busy over JCT (PE node / DE node) | passes over emulated GPU "
                "time | requeued / alloc stalls |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            jcts = {}
            for system in args.systems.split(","):
                agents = agent_scripts(trajs, cfg.model.vocab_size, cfg.workload.seed)
                opts = RuntimeOptions(
                    system=system,
                    kv_root=args.kv_root,
                    transport=transport,
                    transfer_window=window,
                    gpu_time=gpu_time,
                )
                run = _jct_run(cfg, opts, agents)
                res = run["result"]
                summ = summarize(res.records, "offline")
                jct = jcts[system] = summ.jct_s
                pe_mb, de_mb = (
                    res.bytes_by_path[k] / 1e6
                    for k in ("storage_to_pe_buffer", "storage_to_de_buffer")
                )
                busy = [b / jct for b in run["read_busy_s"]]
                cpu = [c / jct for c in run["cpu_s"]]
                floor = max(pe_mb, de_mb) * 1e6 / rate_total  # the busier SNIC's read time
                print(
                    f"| {system} | {jct:.1f} | {summ.ttft.mean:.2f} | "
                    f"{summ.tpot.mean * 1e3:.1f} | {pe_mb:,.0f} / {de_mb:,.0f} | "
                    f"{busy[0]:.0%} / {busy[1]:.0%} | {floor / jct:.0%} | "
                    f"{cpu[0]:.2f} / {cpu[1]:.2f} | {_overruns(res)} | "
                    f"{res.requeued} / {res.alloc_stalls} |"
                )
            print(f"\nat end: {load_average()}")
            if "basic" in jcts:
                for system, jct in jcts.items():
                    if system != "basic":
                        ratio = jcts["basic"] / jct
                        ratios.append((load, gpu_time, transport, window, system, ratio))
                        print(f"\nJCT basic / {system} = **{ratio:.2f}x**")
    if len(ratios) > 1:
        print("\n| background load | GPU time | transport | window | basic / system |")
        print("|---|---|---|---|---|")
        for load, gpu_time, transport, window, system, ratio in ratios:
            print(f"| {load} | {gpu_time} | {transport} | {window} | {system} {ratio:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="batch,hbm,jct")
    ap.add_argument("--concurrent", type=int, default=16, help="requests in the batch / hbm parts")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--hbm-tokens", type=int, default=2048, help="PE/DE HBM pool (hbm part)")
    ap.add_argument("--hbm-agents", type=int, default=32, help="agents of the hbm part")
    ap.add_argument("--hbm-prompt", type=int, default=512, help="turn-1 tokens (hbm part)")
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument(
        "--snic-mb-per-s", type=float, help="emulated SNIC per node, MB/s (jct; default: preset's)"
    )
    ap.add_argument("--gpu-time", default="emulated", help="jct: emulated, host or both")
    ap.add_argument(
        "--background-load", default="0", help="jct: busy-loop processes beside it, e.g. 0,2"
    )
    ap.add_argument("--token-scale", type=float, default=0.25)
    ap.add_argument("--max-gen", type=int, default=4)
    ap.add_argument("--systems", default="basic,dualpath")
    ap.add_argument("--kv-root", default="./.dualpath/bench-kv")
    ap.add_argument("--transport", default="shm", help="shm, mooncake or both: shm,mooncake")
    ap.add_argument("--windows", default="16", help="transfer windows to run, e.g. 1,16")
    args = ap.parse_args()
    base = preset("tiny-1p1d")
    one = replace(base, hardware=replace(base.hardware, gpus_per_node=1))
    parts = args.parts.split(",")
    if "batch" in parts:
        part_batch(one, args)
    if "hbm" in parts:
        part_hbm(replace(one, hardware=replace(one.hardware, snic_bytes_per_s=1e9)), args)
    if "window" in parts:
        part_window(one, args)
    if "jct" in parts:
        part_jct(preset("tiny-testbed"), args)


if __name__ == "__main__":
    main()
