"""The ablation (Basic, +Layer, +DPL, +Sched) with the figures that explain each step.

Same runs as ``dualpath ablation`` (``simulate`` of each system on the preset's config, so
the same JCTs), plus per system: utilisation of the SNICs, CNICs and GPUs, the prefill
batch (largest KV resident in one GPU's HBM vs the HBM cap of the classic path, passes, new
tokens and wall time per pass), TTFT and its parts, TTST, TPOT, the decode step time lost to
KV DMA contention, and the agent that finishes last (its turns and mean time per turn).
To tell storage-bound from latency-bound: the storage floor (the run's read bytes of each
side over that side's SNICs at full rate; no prefill-side change can finish below it), the
time the PE SNICs idled while a read waited for PE buffer space (the only way a faster
prefill could feed the SNICs more) or while requests waited for a classic PE's HBM (Basic:
a read starts only once its HBM is reserved), the time 90% of the agents were done (the tail after it
is the long agents' sequential turns), and the last agent's turns before and after it.

    nice -n 5 .venv/bin/python benchmarks/ablation_breakdown.py --preset ds660b-2p4d \\
        --agents 1024 --mal 64k --workers 2 [--systems basic,layer] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dualpath.config import apply_overrides, preset
from dualpath.models import cost
from dualpath.sim.results import collect
from dualpath.sim.runner import build_cluster, run_cluster
from dualpath.sim.studies import ABLATION_STEPS


def _run(args: tuple[str, list[str], str]) -> dict[str, Any]:
    name, overrides, system = args
    config = apply_overrides(preset(name), overrides)
    t0 = time.perf_counter()
    cluster = build_cluster(config, system)
    run_cluster(cluster)
    result = collect(cluster)
    groups = cluster.prefill_groups
    passes = sum(g.num_passes for g in groups)
    new_tokens = sum(r.prompt_tokens - r.hit_tokens for r in result.records)
    de_gpus = len(cluster.decode_groups[0].members)
    steps = sum(g.num_steps for g in cluster.decode_groups)
    dma = [d for g in cluster.decode_groups for d in g.dma_delay_s]
    busy = [b for g in cluster.decode_groups for b in g.busy_s]
    last = max(result.records, key=lambda r: (r.finish_s, r.agent_id))
    turns_of_last = sum(1 for r in result.records if r.agent_id == last.agent_id)
    summary = result.summary
    hw, cl = config.hardware, config.cluster
    snic = hw.snic_total_bytes_per_s
    floor_s = max(
        result.path_bytes.get("storage_to_pe_buffer", 0.0) / (cl.num_prefill_nodes * snic),
        result.path_bytes.get("storage_to_de_buffer", 0.0) / (cl.num_decode_nodes * snic),
    )
    pe_nodes = [n for n in cluster.node_ios if n.path_kind == "storage_to_pe_buffer"]
    agent_end: dict[int, float] = {}
    for r in result.records:
        agent_end[r.agent_id] = max(agent_end.get(r.agent_id, 0.0), r.finish_s)
    ends = sorted(agent_end.values())
    t90 = ends[max(0, -(-9 * len(ends) // 10) - 1)]  # 90% of the agents finished by t90
    mine = [r for r in result.records if r.agent_id == last.agent_id]

    def turn_means(rs: list) -> dict[str, float]:  # type: ignore[type-arg]
        n = max(1, len(rs))
        return {
            "turns": len(rs),
            "s_per_turn": sum(r.finish_s - r.arrival_s for r in rs) / n,
            "ttft_s": sum(r.first_token_s - r.arrival_s for r in rs) / n,
            "read_wait_s": sum(r.read_start_s - r.scheduled_s for r in rs) / n,
            "prefill_s": sum(r.first_token_s - r.prefill_start_s for r in rs) / n,
            "after_first_token_s": sum(r.finish_s - r.first_token_s for r in rs) / n,
        }

    return {
        "system": system,
        "jct_s": result.jct_s,
        "wall_s": time.perf_counter() - t0,
        "utilisation": {k: v["mean"] for k, v in result.utilisation.items()},
        "hbm_cap_tokens": cost.kv_capacity_tokens(
            config.model, config.hardware, len(groups[0].members)
        ),
        "kv_budget_tokens": groups[0].kv_budget_tokens,
        "max_batch_tokens": max(g.max_batch_tokens for g in groups),
        "prefill_passes": passes,
        "new_tokens_per_pass_per_gpu": new_tokens / max(1, passes) / len(groups[0].members),
        "pass_s_mean": sum(g.pass_s for g in groups) / max(1, passes),
        "ttft_mean_s": summary["ttft_s"]["mean"],
        "ttft_breakdown_s": summary["ttft_breakdown_s"],
        "ttst_mean_s": summary["ttst_s"]["mean"],
        "tpot_mean_s": summary["tpot_s"]["mean"],
        "agent_jct_mean_s": summary["agent_jct_s"]["mean"],
        "decode_steps": steps,
        "dma_delay_share": sum(dma) / max(1e-12, sum(busy)),
        "de_gpus_per_group": de_gpus,
        "last_agent": last.agent_id,
        "last_agent_turns": turns_of_last,
        "last_agent_s_per_turn": last.finish_s / turns_of_last,
        "storage_floor_s": floor_s,
        "pe_buffer_blocked_s": sum(n.buffer_blocked_s for n in pe_nodes) / max(1, len(pe_nodes)),
        "pe_hbm_blocked_s": sum(n.hbm_blocked_s for n in pe_nodes) / max(1, len(pe_nodes)),
        "t90_s": t90,
        "last_agent_before_t90": turn_means([r for r in mine if r.finish_s <= t90]),
        "last_agent_after_t90": turn_means([r for r in mine if r.finish_s > t90]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ds660b-2p4d")
    ap.add_argument("--agents", type=int, default=1024)
    ap.add_argument("--mal", default="64k")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--systems",
        default=",".join(system for system, _ in ABLATION_STEPS),
        help="comma-separated subset of the ablation steps (each step is compared with the "
        "previous one listed)",
    )
    args = ap.parse_args()
    known = [system for system, _ in ABLATION_STEPS]
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in known]
    if bad or not wanted:
        ap.exit(2, f"ablation_breakdown: error: --systems={args.systems!r}: use some of {known}\n")
    steps = [(system, label) for system, label in ABLATION_STEPS if system in wanted]
    overrides = [f"workload.num_agents={args.agents}", f"workload.mal={args.mal}", *args.set]
    jobs = [(args.preset, overrides, system) for system, _ in steps]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        rows = list(pool.map(_run, jobs))
    print(f"{args.preset}, {args.agents} agents, MAL {args.mal} {' '.join(args.set)}")
    prev = base = 0.0
    for (_, label), row in zip(steps, rows, strict=True):
        jct = row["jct_s"]
        base = base or jct
        step = f"{100 * (jct / prev - 1):+.1f}%" if prev else "—"
        prev = jct
        u = row["utilisation"]
        b = row["ttft_breakdown_s"]
        print(
            f"{label:<7} JCT {jct:8.1f} s  step {step:>7}  ×Basic {base / jct:.2f}  "
            f"SNIC PE/DE {u['pe_snic_read']:.0%}/{u['de_snic_read']:.0%}  "
            f"GPU PE/DE {u['pe_gpu']:.0%}/{u['de_gpu']:.0%}  "
            f"CNIC PE tx/rx {u['pe_cnic_tx']:.0%}/{u['pe_cnic_rx']:.0%}  (wall {row['wall_s']:.0f} s)"
        )
        print(
            f"        batch max {row['max_batch_tokens']:,} tok/GPU (HBM cap "
            f"{row['hbm_cap_tokens']:,}, budget {row['kv_budget_tokens']})  passes "
            f"{row['prefill_passes']:,}  new tok/pass/GPU {row['new_tokens_per_pass_per_gpu']:,.0f}  "
            f"pass {row['pass_s_mean']:.3f} s"
        )
        print(
            f"        TTFT {row['ttft_mean_s']:.2f} s (queue {b['queue']:.2f} read {b['read']:.2f} "
            f"alloc {b['alloc']:.2f} prefill {b['prefill']:.2f})  TTST {row['ttst_mean_s'] * 1e3:.0f} ms  "
            f"TPOT {row['tpot_mean_s'] * 1e3:.1f} ms  DMA share of decode {row['dma_delay_share']:.2%}"
        )
        print(
            f"        agent JCT mean {row['agent_jct_mean_s']:.0f} s; last agent {row['last_agent']}: "
            f"{row['last_agent_turns']} turns, {row['last_agent_s_per_turn']:.2f} s/turn"
        )
        print(
            f"        storage floor {row['storage_floor_s']:.0f} s; PE SNIC idle waiting for "
            f"buffer space {row['pe_buffer_blocked_s']:.1f} s/node, waiting for HBM (classic "
            f"admission) {row['pe_hbm_blocked_s']:.1f} s/node; 90% of agents done at "
            f"{row['t90_s']:.0f} s"
        )
        for part in ("before", "after"):
            t = row[f"last_agent_{part}_t90"]
            print(
                f"        last agent {part} t90: {t['turns']} turns, {t['s_per_turn']:.2f} s/turn "
                f"= TTFT {t['ttft_s']:.2f} (read wait {t['read_wait_s']:.2f}, prefill "
                f"{t['prefill_s']:.2f}) + after token 1 {t['after_first_token_s']:.2f}"
            )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ablation_breakdown.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
