"""The prefill's KV to the decode node across nodes: layer by layer while the prefill computes
(the router's default) against after the prefill answered (``DUALPATH_HANDOVER=after``).

Run: .venv/bin/python benchmarks/bench_handover.py [--prompts 12 --words 900 --cnic-mbit 640]

Makes a 1P1D cluster of network namespaces (`dualpath cluster up`, tiny-1p1d, needs root):
SNICs of 2 Gbit/s (storage is not what this measures), CNICs shaped by the kernel to
--cnic-mbit. Then, for each hand-over, interleaved --rounds times on the same cluster: `dualpath
serve --engine vllm --system dualpath --cluster` on a tiny random Llama (4 layers) in a fresh
KV store, and --prompts prompts of --words random words each at concurrency 1, every one new
(no hits: the whole prompt is prefilled and handed over), max_tokens 1, streamed. Prints per
run the time to first token (p50, mean), the router's prefill and hand-over stages (the wait
after the prefill answered, ``cnic_kv``), and the KV bytes pushed per request and their time
at the CNIC's rate; then the hand-over's mean wait and TTFT p50, layerwise ÷ after.

With --shapes it checks the model shapes instead: for a tiny Llama (2 KV heads: each of two
tensor-parallel ranks writes one) and a tiny DeepSeek-V3 (MLA: one rank writes the latent), a
prefill instance of --prefill-tp ranks and a decode of one, each hand-over on a fresh cluster,
4 prompts × 2 turns (the second hits), greedy, 8 tokens: the answers of both hand-overs must be
equal and, layerwise, no slot may be left to push after the prefill (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import (  # type: ignore[import-not-found]
    CLUSTER,
    FAST_SNIC_MBIT,
    _checkpoint,
    _metrics,
    _serve,
    _stop,
)

MODES = ("after", "layerwise")


def _cluster(cnic_mbit: float) -> None:
    from dualpath.deploy import cluster

    cluster.down(CLUSTER)
    spec = cluster.ClusterSpec.from_preset(
        "tiny-1p1d", name=CLUSTER, snic_mbit=FAST_SNIC_MBIT, cnic_cap_mbit=cnic_mbit
    )
    cluster.up(spec)


def _prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(2000)]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def _ttft(url: str, model: str, prompt: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise SystemExit(f"the router answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise SystemExit("the router's stream ended without a token")


def _run(ckpt: Path, root: Path, mode: str, prompts: list[str]) -> dict[str, Any]:
    log = root / f"{mode}.log"
    proc, url = _serve(
        ckpt,
        root / f"kv-{mode}-{time.monotonic_ns()}",
        "dualpath",
        0.0,
        log,
        True,
        ([], [], []),
        mode,
    )
    try:
        for p in _prompts(2, 50, seed=7):  # warm-up: vLLM's first steps
            _ttft(url, ckpt.name, p)
        before = _metrics(url)
        ttfts = [_ttft(url, ckpt.name, p) for p in prompts]
        after = _metrics(url)
    finally:
        _stop(proc)
    n = len(prompts)

    def per_request(kind: str, key: str) -> float:
        return (after[kind].get(key, 0.0) - before[kind].get(key, 0.0)) / n

    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3,
        "prefill_ms": per_request("stage_s", "prefill") * 1e3,
        "cnic_kv_ms": per_request("stage_s", "cnic_kv") * 1e3,
        "kv_mb": per_request("kv_mb", "pe_hbm_to_de_buffer"),
        "stages_ms": {k: per_request("stage_s", k) * 1e3 for k in sorted(after["stage_s"])},
    }


def _answers(ckpt: Path, root: Path, mode: str, prefill_tp: int) -> tuple[list[str], float]:
    """The greedy answers of a fresh deployment and the slots it pushed after prefills."""
    from dualpath.deploy import cluster

    cluster.down(CLUSTER)
    cluster.up(cluster.ClusterSpec.from_preset("tiny-1p1d", name=CLUSTER, snic_mbit=FAST_SNIC_MBIT))
    vllm = ([], [f"--tensor-parallel-size={prefill_tp}"], ["--tensor-parallel-size=1"])
    kv = root / f"kv-{mode}-{time.monotonic_ns()}"
    proc, url = _serve(ckpt, kv, "dualpath", 0.0, root / f"{mode}.log", True, vllm, mode)
    texts: list[str] = []
    try:
        for prompt in _prompts(4, 300, seed=5):
            for _ in range(2):  # the second turn hits the first's blocks
                body = {"model": ckpt.name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
                r = httpx.post(url + "/v1/completions", json=body, timeout=300)
                if r.status_code != 200:
                    raise SystemExit(f"{mode}: the router answered {r.status_code}: {r.text[:300]}")
                texts.append(r.json()["choices"][0]["text"])
                prompt += texts[-1] + " and then"
        after = 0.0
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("dualpath:handover_slots_pushed_after_total"):
                after += float(line.rsplit(" ", 1)[1])
    finally:
        _stop(proc)
    return texts, after


def _shapes(prefill_tp: int) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model in ("llama", "deepseek-v3"):
            ckpt = _checkpoint(root, model)
            ref, _ = _answers(ckpt, root, "after", prefill_tp)
            got, left = _answers(ckpt, root, "layerwise", prefill_tp)
            ok = got == ref and left == 0
            bad += not ok
            print(
                f"{model} (prefill TP {prefill_tp}): {len(got)} answers, layerwise "
                f"{'equal to' if got == ref else 'DIFFERENT from'} after; slots pushed after "
                f"the prefill {left:g}: {'ok' if ok else 'FAILED'}",
                flush=True,
            )
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12, help="prompts per run, one at a time")
    ap.add_argument("--words", type=int, default=900, help="random words per prompt")
    ap.add_argument("--cnic-mbit", type=float, default=640.0, help="each node's CNIC")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each hand-over, interleaved")
    ap.add_argument("--shapes", action="store_true", help="check TP and MLA answers instead")
    ap.add_argument("--prefill-tp", type=int, default=2, help="with --shapes: the prefill's TP")
    args = ap.parse_args()
    from dualpath.deploy.cluster import can_make_namespaces

    if (reason := can_make_namespaces()) is not None:
        raise SystemExit(f"bench_handover: {reason}")
    if args.shapes:
        try:
            sys.exit(_shapes(args.prefill_tp))
        finally:
            from dualpath.deploy import cluster

            cluster.down(CLUSTER)
    rate_mb = args.cnic_mbit / 8
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        _cluster(args.cnic_mbit)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            ckpt = _checkpoint(root, "llama")
            for r in range(args.rounds):
                for mode in MODES:
                    prompts = _prompts(args.prompts, args.words, seed=100 * r + len(mode))
                    s = _run(ckpt, root, mode, prompts)
                    results[mode].append(s)
                    print(
                        f"{mode:9s} round {r + 1}: TTFT p50 {s['ttft_p50_ms']:.1f} ms, mean "
                        f"{s['ttft_mean_ms']:.1f} ms; per request: prefill "
                        f"{s['prefill_ms']:.1f} ms, hand-over wait after it "
                        f"{s['cnic_kv_ms']:.1f} ms, {s['kv_mb']:.2f} MB of KV "
                        f"({s['kv_mb'] / rate_mb * 1e3:.1f} ms at the CNIC's "
                        f"{args.cnic_mbit:g} Mbit/s)",
                        flush=True,
                    )
                    print(
                        " " * 10
                        + "router ms/request by stage: "
                        + "  ".join(f"{k} {v:.1f}" for k, v in s["stages_ms"].items()),
                        flush=True,
                    )
    finally:
        from dualpath.deploy import cluster

        cluster.down(CLUSTER)

    def mean(mode: str, key: str) -> float:
        return statistics.fmean(s[key] for s in results[mode])

    print(
        f"hand-over wait after the prefill: layerwise {mean('layerwise', 'cnic_kv_ms'):.1f} ms, "
        f"after {mean('after', 'cnic_kv_ms'):.1f} ms; TTFT p50 layerwise ÷ after: "
        f"{mean('layerwise', 'ttft_p50_ms') / mean('after', 'ttft_p50_ms'):.2f} "
        f"({args.prompts} prompts of {args.words} words per run, {args.rounds} round(s))"
    )


if __name__ == "__main__":
    main()
