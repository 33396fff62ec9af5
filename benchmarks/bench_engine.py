"""The one engine on an HF checkpoint: generated tokens/s vs transformers' batched ``generate``,
start-up (ready) time, and resident memory per engine process — all measured in one run.

Run: .venv/bin/python benchmarks/bench_engine.py [--parts throughput,ready,rss] [--before SRC]

- ``throughput``: a random ~25M-parameter Llama (hidden 512, 8 layers, 8 heads / 4 KV heads,
  FFN 1408; written locally with ``save_pretrained``), ``--requests`` concurrent requests of
  ``--prompt`` random tokens and ``--new`` greedy tokens each. transformers: one batched
  ``generate`` of the same batch (no padding: equal lengths), at the host's thread count and at
  one thread (one engine's share on a 2-core host). The engine: the DualPath runtime, 1P1D,
  every request submitted at once; tokens/s = generated tokens / (last finish − first
  submission), start-up excluded; once with KV traffic paced by the preset's emulated NICs
  (``dualpath``) and once unpaced (``oracle``: the engines' own speed).
- ``ready``: seconds from ``Runtime`` entry to every process acked, for the tiny model and
  the checkpoint, on this tree and (``--before SRC``) another tree in the same run, each in a
  fresh interpreter, alternating, best of ``--repeats``.
- ``rss``: each engine process's resident memory once ready: anonymous (private) and
  file-backed (the memory-mapped weights, shared through the page cache).
A memcpy reference (GB/s) is printed first: speeds on another host compare through it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARCH = dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1408)


def memcpy_gbps() -> float:
    import torch

    src = torch.ones(64 << 18)  # 64 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def write_checkpoint(root: Path) -> Path:
    from dualpath.frontend.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(root / "bench-llama-25m", arch="llama", **ARCH)


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def isolated(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a fresh spawned process: the runtime's scheduler runs in this one, and
    must not inherit transformers' torch threads (measured: 1.6x slower runs when it did)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def hf_generate(
    ckpt: Path, batch: list[list[int]], new: int, threads: int, dtype: str = "float32"
) -> float:
    """tokens/s of one batched greedy ``generate`` (best of two, after a warm-up)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=getattr(torch, dtype)
    )
    model.eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(batch)
    best = float("inf")
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        for _ in range(2):
            t0 = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
            best = min(best, time.perf_counter() - t0)
    return len(batch) * new / best


def engine_tokens_per_s(
    ckpt: Path, batch: list[list[int]], new: int, system: str, dtype: str = "float32"
) -> float:
    """tokens/s of the runtime on the batch: every request one agent's single turn."""
    from dualpath.config import preset
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.runtime.requests import AgentState
    from dualpath.runtime.session import Runtime

    cfg = preset("tiny-1p1d")
    root = tempfile.mkdtemp(prefix="bench-engine-")
    try:
        opts = RuntimeOptions(
            system=system,
            kv_root=root,
            model_dir=str(ckpt),
            hbm_tokens=16384,
            dtype=dtype,
            threads=int(os.environ.get("BENCH_THREADS", "0")),
        )
        best = float("inf")
        with Runtime(cfg, opts) as rt:
            for rep in range(2):  # the second batch differs by its first token: no hits
                agents = [
                    AgentState(rep * len(batch) + i, ((rep, *p[1:]),), (new,))
                    for i, p in enumerate(batch)
                ]
                t0 = time.perf_counter()
                records = rt.run(agents).records[rep * len(batch) :]
                best = min(best, time.perf_counter() - t0)
                assert sum(r.output_tokens for r in records) == len(batch) * new
                assert sum(r.hit_tokens for r in records) == 0
        return len(batch) * new / best
    finally:
        shutil.rmtree(root, ignore_errors=True)


_READY = """
import json, sys, tempfile, time
def main():
    t0 = time.monotonic()
    from dualpath.config import preset
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.runtime.session import Runtime
    kw = json.loads(sys.argv[1])
    root = tempfile.mkdtemp(prefix="bench-ready-")
    rss = {}
    with Runtime(preset("tiny-1p1d"), RuntimeOptions(kv_root=root, **kw)) as rt:
        ready = time.monotonic() - t0
        for name, proc in rt.launcher.procs.items():
            if name.startswith(("pe", "de")):
                status = open(f"/proc/{proc.pid}/status").read().splitlines()
                fields = dict(line.split(":", 1) for line in status if ":" in line)
                rss[name] = {k: int(fields[k].split()[0]) // 1024
                             for k in ("VmRSS", "RssAnon", "RssFile") if k in fields}
    print(json.dumps({"ready_s": ready, "rss_mib": rss}))
if __name__ == "__main__":
    main()
"""


def ready_run(src: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Start and stop a runtime from tree ``src`` in a fresh interpreter; its figures."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_READY)
    env = {**os.environ, "PYTHONPATH": str(src / "src")}
    try:
        out = subprocess.run(
            [sys.executable, f.name, json.dumps(kwargs)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        ).stdout
    finally:
        os.unlink(f.name)
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="throughput,ready,rss")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16, for both sides")
    ap.add_argument("--before", help="another source tree to measure ready time against")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    print(f"host: {os.cpu_count()} cores; memcpy reference {memcpy_gbps():.1f} GB/s")
    root = Path(tempfile.mkdtemp(prefix="bench-engine-ckpt-"))
    try:
        ckpt = write_checkpoint(root)
        from dualpath.runtime.hf_model import HFSpec, model_config

        spec = HFSpec.from_dir(ckpt)
        params = model_config(spec, "float32", "x").total_params
        print(f"checkpoint: {ckpt.name}, {params / 1e6:.1f}M parameters, vocab {spec.vocab_size}")
        if "throughput" in parts:
            batch = prompts(spec.vocab_size, args.requests, args.prompt)
            print(
                f"\nthroughput: {args.requests} requests x ({args.prompt} prompt + {args.new} "
                f"new tokens), greedy, {args.dtype}"
            )
            cores = os.cpu_count() or 1
            ref = {
                t: isolated(hf_generate, ckpt, batch, args.new, t, args.dtype)
                for t in sorted({cores, 1})
            }
            for t, v in ref.items():
                print(f"  transformers generate, {t} thread(s): {v:8.1f} tok/s")
            for system in ("oracle", "dualpath"):
                v = engine_tokens_per_s(ckpt, batch, args.new, system, args.dtype)
                ratios = ", ".join(f"{v / r:.2f}x of {t}-thread" for t, r in ref.items())
                print(f"  engine ({system:8s}, 1P1D):        {v:8.1f} tok/s  ({ratios})")
        if "ready" in parts or "rss" in parts:
            trees = [("this tree", REPO)] + ([("before", Path(args.before))] if args.before else [])
            models: list[tuple[str, dict[str, Any]]] = [
                ("tiny", {}),
                ("checkpoint", {"model_dir": str(ckpt)}),
            ]
            print(
                f"\nready time (s, best of {args.repeats}) and engine RSS (MiB: total / anon / file)"
            )
            for label, kw in models:
                for tree, src in trees:
                    if tree == "before" and kw:  # an older tree may not run checkpoints
                        try:
                            ready_run(src, kw)
                        except subprocess.CalledProcessError:
                            print(f"  {label:10s} {tree:9s}: not supported")
                            continue
                    runs = [ready_run(src, kw) for _ in range(args.repeats)]
                    best = min(r["ready_s"] for r in runs)
                    rss = runs[-1]["rss_mib"]
                    mem = "  ".join(
                        f"{n} {v.get('VmRSS')}/{v.get('RssAnon')}/{v.get('RssFile')}"
                        for n, v in sorted(rss.items())
                    )
                    print(f"  {label:10s} {tree:9s}: ready {best:5.2f} s   {mem}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
