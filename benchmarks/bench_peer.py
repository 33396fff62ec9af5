"""Our engine against vLLM on the same host and checkpoint: throughput, TTFT, TPOT, ITL, start, stop.

Run: .venv/bin/python benchmarks/bench_peer.py [--concurrency 1,4,16,64 --repeats 2 --turns 4]

Writes a tiny random Llama checkpoint (4 layers, hidden 256, head_dim 64, float32), then, on
127.0.0.1, for every repeat and every concurrency C, one after the other (interleaved):

  ours        `dualpath serve` on the checkpoint, the emulated NICs unpaced (--snic-mb-per-s
              100000): the engine's own speed
  ours-paced  `dualpath serve` with the preset's emulated SNIC (the default, storage-paced)
  vllm        plain vLLM CPU (`.venv-vllm`, float32, its prefix cache; one server for the whole
              run, its prefix cache reset before each run: VLLM_SERVER_DEV_MODE's
              /reset_prefix_cache)

each replaying the same design §9 agents (max(C, 16) agents x --turns, appends x --token-scale,
--max-gen tokens, greedy, ignore_eos) through `dualpath loadgen` at concurrency C; every run has
a fresh cache (ours: a new server on a new KV store; vllm: reset) and its own seed (the same
seed for every variant of a repeat). Prints per C the median over repeats of requests/s, TTFT,
TPOT, ITL (the gap between streamed chunks, as vLLM's benchmark_serving: bursts show as gaps
near 0) p50 / p99, the ratios ours / vllm, and the targets (`_targets`) met or not; ready and
SIGTERM seconds of every `dualpath serve`. Where vLLM is not installed it says so in one line
and measures ours alone. The figures mean something only on a quiet host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions
from dualpath.workload.scripts import chat_scripts
from servers import Server, dualpath_serve, plain_vllm, tiny_llama, vllm_python

VARIANTS = {
    "ours": ["--snic-mb-per-s", "100000"],
    "ours-paced": [],
}


def _load(
    url: str,
    model: str,
    concurrency: int,
    agents: int,
    turns: int,
    scale: float,
    max_gen: int,
    seed: int,
) -> dict[str, Any]:
    warm = chat_scripts(2, 2, scale, 8, 32, seed=10_000 + seed)
    asyncio.run(LoadGenerator(LoadgenOptions(url, model=model, concurrency=2)).run(warm))
    scripts = chat_scripts(agents, turns, scale, max_gen, 32, seed=seed)
    gen = LoadGenerator(LoadgenOptions(url, model=model, concurrency=concurrency))
    return asyncio.run(gen.run(scripts)).summary()


def _figures(s: dict[str, Any]) -> dict[str, float]:
    return {
        "req_s": s["requests_per_s"],
        "ttft_p50": s["ttft_s"]["p50"],
        "ttft_p99": s["ttft_s"]["p99"],
        "tpot_p50": s["tpot_s"]["p50"],
        "tpot_p99": s["tpot_s"]["p99"],
        "itl_p50": s["chunk_gap_s"]["p50"],
        "itl_p99": s["chunk_gap_s"]["p99"],
        "errors": s["errors"],
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _row(name: str, f: dict[str, float]) -> str:
    ms = 1e3
    return (
        f"  {name:<11}{f['req_s']:7.2f}  {f['ttft_p50'] * ms:7.1f} {f['ttft_p99'] * ms:7.1f}"
        f"  {f['tpot_p50'] * ms:6.1f} {f['tpot_p99'] * ms:6.1f}  {f['itl_p50'] * ms:6.1f} "
        f"{f['itl_p99'] * ms:6.1f}  {int(f['errors'])}"
    )


def _targets(c: int, ours: dict[str, float], peer: dict[str, float]) -> list[str]:
    """Our targets against vLLM at concurrency ``c`` (ours unpaced): requests/s at 16 at least
    0.9×, TTFT p50 at 1 and 16 at most 1.5×, ITL p50 / TPOT p50 at 16 at least 0.5."""
    out = []
    ttft = ours["ttft_p50"] / peer["ttft_p50"]
    if c == 16:
        rps = ours["req_s"] / peer["req_s"]
        out.append(
            f"requests/s {rps:.2f}x vLLM (target >= 0.9): {'met' if rps >= 0.9 else 'NOT met'}"
        )
    if c in (1, 16):
        out.append(
            f"TTFT p50 {ttft:.2f}x vLLM (target <= 1.5): {'met' if ttft <= 1.5 else 'NOT met'}"
        )
    if c == 16:
        burst = ours["itl_p50"] / ours["tpot_p50"] if ours["tpot_p50"] else 0.0
        out.append(
            f"ITL p50 / TPOT p50 {burst:.2f} (target >= 0.5, no bursts): "
            f"{'met' if burst >= 0.5 else 'NOT met'}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--token-scale", type=float, default=0.05)
    ap.add_argument("--max-gen", type=int, default=32)
    ap.add_argument("--variants", default="ours,ours-paced,vllm")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `dualpath serve` args")
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    try:
        concs = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        raise SystemExit(
            f"--concurrency {args.concurrency!r}: a comma-separated list of integers"
        ) from None
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in (*VARIANTS, "vllm")]
    if unknown or not concs or min(concs) < 1 or args.repeats < 1:
        raise SystemExit(
            f"bad arguments: variants {unknown or 'ok'}, concurrency {concs}, "
            f"repeats {args.repeats}"
        )
    if "vllm" in variants and vllm_python() is None:
        print("bench_peer: vLLM is not installed (make vllm): measuring our engine alone")
        variants.remove("vllm")
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    starts: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp))
        vllm: Server | None = None
        if "vllm" in variants:
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
            vllm = plain_vllm(ckpt, Path(tmp) / "vllm.log")
            print(f"vllm ready in {vllm.ready_s:.1f} s", flush=True)
        try:
            for rep in range(args.repeats):
                for c in concs:
                    seed = rep * 1000 + c
                    agents = max(16, c)
                    for v in variants:
                        load = (c, agents, args.turns, args.token_scale, args.max_gen, seed)
                        if v == "vllm":
                            assert vllm is not None
                            r = httpx.post(vllm.url + "/reset_prefix_cache", timeout=30)
                            if r.status_code != 200:
                                raise SystemExit(f"vllm /reset_prefix_cache: HTTP {r.status_code}")
                            s = _load(vllm.url, ckpt.name, *load)
                        else:
                            run_dir = Path(tmp) / f"{v}-{rep}-{c}"
                            with dualpath_serve(
                                ckpt,
                                run_dir / "kv",
                                Path(tmp) / f"{v}.log",
                                [*VARIANTS[v], *args.serve_arg],
                            ) as srv:
                                s = _load(srv.url, ckpt.name, *load)
                            starts.append((v, srv.ready_s, srv.stop_s))
                        runs.setdefault((v, c), []).append(_figures(s))
                        f = runs[(v, c)][-1]
                        print(
                            f"repeat {rep + 1} C={c:<3} {v:<11} {f['req_s']:6.2f} req/s  TTFT "
                            f"p50 {f['ttft_p50'] * 1e3:7.1f} ms  errors {int(f['errors'])}",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            if vllm is not None:
                vllm.stop()
    load = os.getloadavg()[0]
    print(
        f"\nmedians over {args.repeats} repeat(s); {args.turns} turns per agent, appends x "
        f"{args.token_scale}, {args.max_gen} tokens per turn; host {os.cpu_count()} CPUs, "
        f"load {load:.1f}"
    )
    for c in concs:
        print(
            f"concurrency {c} ({max(16, c)} agents)   req/s   TTFT p50/p99 ms  TPOT p50/p99"
            f"   ITL p50/p99  errors"
        )
        med = {v: _median(runs[(v, c)]) for v in variants}
        for v in variants:
            print(_row(v, med[v]))
        if "ours" in med and "vllm" in med:
            o, p = med["ours"], med["vllm"]
            print(
                f"  ours / vllm: req/s {o['req_s'] / p['req_s']:.2f}x  TTFT p50 "
                f"{o['ttft_p50'] / p['ttft_p50']:.2f}x  TPOT p50 {o['tpot_p50'] / p['tpot_p50']:.2f}x"
                f"  ITL p50 {o['itl_p50'] / p['itl_p50']:.2f}x"
            )
            for line in _targets(c, o, p):
                print("  target: " + line)
    if starts:
        ready = [r for _, r, _ in starts]
        stop = [s for _, _, s in starts]
        print(
            f"dualpath serve: ready p50 {statistics.median(ready):.1f} s (max {max(ready):.1f}), "
            f"SIGTERM to exit p50 {statistics.median(stop):.1f} s (max {max(stop):.1f}) over "
            f"{len(starts)} starts"
        )
    if args.json:
        out = {f"{v}@{c}": r for (v, c), r in runs.items()}
        Path(args.json).write_text(json.dumps({"runs": out, "starts": starts}, indent=2))


if __name__ == "__main__":
    main()
