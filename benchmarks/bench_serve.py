"""`dualpath loadgen` against `dualpath serve`: DualPath vs Basic over HTTP, concurrent agents.

Run: .venv/bin/python benchmarks/bench_serve.py [--variants basic,dualpath --agents 32 ...]
Builds a tiny random Llama checkpoint (4 layers, hidden 256: the built-in tiny model's shape)
in a temporary folder, then for each variant starts a fresh `dualpath serve --model-dir` (the
DualPath runtime: scheduler, storage workers, 2 PE + 2 DE engine processes, tiny-1p1d, a fresh
KV store each) on 127.0.0.1 and replays the same design §9 agents (scaled) through the HTTP API:

  basic      --system basic: hit KV loaded only through the PE node's SNIC
  dualpath   --system dualpath: hit KV through the PE or the DE node's SNIC (the second
             path), the policy picks per request
  tiny-basic / tiny-dualpath: the same on the built-in tiny model (no --model-dir)

The emulated SNIC runs at ``--snic-mb-per-s`` (default 5 MB/s: low enough that storage reads
bind on a 2-core host; at 30 MB/s the CPUs bind and the systems tie). ``--duration 0`` (the
default) runs every turn of every agent (fixed work: the job JCT compares the systems);
``--duration S`` stops starting turns after S seconds.

Prints requests/s, output tokens/s, TTFT / TPOT / agent-JCT p50 and p99, job JCT, hit ratio,
errors, KV bytes per load path (from /metrics) per variant, and the host's 1-minute load
average before each (the figures only mean something on a quiet host: other processes on the
CPUs inflate every latency). docs/serving.md has the measured table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dualpath.frontend.checkpoint import write_tiny_checkpoint
from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions
from dualpath.net import free_port
from dualpath.workload.scripts import chat_scripts

VARIANTS = {
    "basic": ["--system", "basic"],
    "dualpath": ["--system", "dualpath"],
    "tiny-basic": ["--system", "basic"],
    "tiny-dualpath": ["--system", "dualpath"],
}
RUNTIME_ARGS = ["--preset", "tiny-1p1d", "--hbm-tokens", "16384"]


def _start(
    model_args: list[str], extra: list[str], threads: int
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dualpath.cli.main", "serve", *model_args]
    cmd += ["--port", str(port), "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def _kv_bytes(url: str) -> dict[str, float]:
    """``dualpath:kv_bytes_total{path=...}`` from the server's /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('dualpath:kv_bytes_total{path="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=32, help="concurrent agent sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns per agent")
    ap.add_argument(
        "--duration", type=float, default=0.0, help="seconds of load per variant (0: all turns)"
    )
    ap.add_argument("--snic-mb-per-s", type=float, default=5.0, help="emulated SNIC, MB/s")
    ap.add_argument("--token-scale", type=float, default=0.05)
    ap.add_argument("--max-gen", type=int, default=16)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per engine (0: the server's default)"
    )
    ap.add_argument("--variants", default="basic,dualpath")
    ap.add_argument("--json", help="write all summaries here")
    args = ap.parse_args()
    scripts = chat_scripts(args.agents, args.turns, args.token_scale, args.max_gen, seed=0)
    warmup = chat_scripts(4, 2, args.token_scale, args.max_gen, seed=99)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(
            Path(tmp) / "llama-4l-256", num_layers=4, hidden_size=256, intermediate_size=688
        )
        for name in [v for v in args.variants.split(",") if v]:
            if name not in VARIANTS:
                raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
            model_args = [*RUNTIME_ARGS, "--kv-root", str(Path(tmp) / f"kv-{name}")]
            model_args += ["--snic-mb-per-s", str(args.snic_mb_per_s)]
            if not name.startswith("tiny-"):
                model_args += ["--model-dir", str(ckpt)]
            proc, url = _start(model_args, VARIANTS[name], args.threads)
            try:
                # warm-up (first forwards of a process are slow), on prompts the run never sends
                asyncio.run(LoadGenerator(LoadgenOptions(url, concurrency=4)).run(warmup))
                load_before = os.getloadavg()[0]
                duration = args.duration or None
                opts = LoadgenOptions(url, concurrency=args.agents, duration_s=duration)
                res = asyncio.run(LoadGenerator(opts).run(scripts))
                kv_bytes = _kv_bytes(url)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            results[name] = s = {**res.summary(), "kv_bytes_by_path": kv_bytes}
            print(
                f"{name:<10} req/s {s['requests_per_s']:6.2f}  out tok/s "
                f"{s['output_tokens_per_s']:7.1f}  TTFT p50/p99 {s['ttft_s']['p50'] * 1e3:7.1f}/"
                f"{s['ttft_s']['p99'] * 1e3:7.1f} ms  TPOT p50/p99 {s['tpot_s']['p50'] * 1e3:6.1f}/"
                f"{s['tpot_s']['p99'] * 1e3:6.1f} ms  agent JCT p50/p99 "
                f"{s['agent_jct_s']['p50']:6.1f}/{s['agent_jct_s']['p99']:6.1f} s  job JCT "
                f"{s['job_jct_s']:6.1f} s  hit {s['hit_ratio']:.3f}  "
                f"requests {s['requests']}  errors {s['errors']}  wall {s['wall_s']:.1f} s  "
                f"host load {load_before:.1f}",
                flush=True,
            )
            if kv_bytes:
                paths = "  ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(kv_bytes.items()))
                print(f"{'':<10} KV MB by path (server /metrics): {paths}", flush=True)
    print(
        f"host: {os.cpu_count()} CPUs; torch threads per engine {args.threads or 'auto'}; "
        f"{args.agents} agents, appends × {args.token_scale}, gen ≤ {args.max_gen}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
