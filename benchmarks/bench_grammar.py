"""The cost of constrained decoding: the grammar mask per step, and served tokens/s with and
without it on the same load.

Run: .venv/bin/python benchmarks/bench_grammar.py [--requests 16 --concurrency 8]

1. Mask cost: for vocabularies of 1K (the tiny model) and a synthetic 32K / 128K byte
   vocabulary, one step's mask of a JSON-schema grammar mid-string for 8 or 32 rows:
   llguidance's fill row by row (before) and batched (``fill_masks``, llguidance's
   ``fill_next_token_bitmask_par``: after), then ``apply_masks`` writing -inf, against a bare
   ``argmax`` over the same logits (measured in the same run).
2. Served: a fresh ``dualpath serve`` (tiny-1p1d, the built-in tiny model) gets the same
   ``--requests`` chat requests (``--concurrency`` at once, greedy), first free text, then
   with ``response_format`` json_schema; prints output tokens/s and TTFT / request p50 for
   each. Free text runs to ``max_tokens`` (ignore_eos); the JSON replies end when the
   grammar does, so tokens/s is the comparable figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from dualpath.frontend.tokenizer import TinyTokenizer
from dualpath.frontend.tools import json_grammar
from dualpath.net import free_port
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.token_choice import (
    Chooser,
    GrammarCache,
    apply_masks,
    build_tokenizer,
    fill_masks,
)
from dualpath.tokens import VocabSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


def synthetic_vocab(size: int, seed: int = 0) -> VocabSpec:
    """Every byte, then random 2–8 letter pieces (a BPE-like vocabulary without a corpus)."""
    rng = random.Random(seed)
    tokens: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    letters = b'abcdefghijklmnopqrstuvwxyz _ETAONIS,.:"{}'
    while len(tokens) < size:
        t = bytes(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    tokens.append(b"<|im_end|>")
    return VocabSpec(
        tokens=tuple(tokens), special_ids=(len(tokens) - 1,), eos_token_ids=(len(tokens) - 1,)
    )


def mask_cost(name: str, spec: VocabSpec, prefix: bytes, batch: int = 8, repeat: int = 200) -> None:
    """One step's mask for ``batch`` constrained rows: llguidance's fill row by row (before)
    and batched (``fill_masks``: ``fill_next_token_bitmask_par``, after), then ``apply_masks``;
    against a bare argmax of the same rows."""
    vocab = len(spec.tokens) if spec.tokens else 0
    tok = build_tokenizer(spec, vocab or 512)
    vocab = vocab or tok.vocab_size
    grammars = GrammarCache(tok, vocab)
    grammar = json_grammar(SCHEMA)
    choosers = [
        Chooser(SamplingParams(grammar=grammar), tok.tokenize_bytes(prefix), grammars)
        for _ in range(batch)
    ]
    logits = torch.randn(batch, vocab)
    masks = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)

    def timed(step: Any) -> float:
        step()  # (warm: the executor's threads start on its first batch)
        t0 = time.perf_counter()
        for _ in range(repeat):
            step()
        return (time.perf_counter() - t0) / repeat

    rows_s = timed(lambda: [c.fill_mask(masks[k]) for k, c in enumerate(choosers)])
    par_s = timed(lambda: fill_masks(choosers, masks))
    apply_s = timed(lambda: apply_masks(logits.clone(), list(range(batch)), masks))
    ref_s = timed(lambda: logits.clone().argmax(-1))
    print(
        f"  {name:<14} vocab {vocab:>7,} x {batch:>2} rows: fill row by row {rows_s * 1e3:6.3f} ms,"
        f" batched {par_s * 1e3:6.3f} ms; apply {apply_s * 1e3:6.3f} ms"
        f" (argmax of the same rows {ref_s * 1e3:6.3f} ms)"
    )


async def served(url: str, requests: int, concurrency: int, constrained: bool) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    e2e: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Weather report {i}, as JSON please."}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if constrained:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA},
            }
        else:
            body["ignore_eos"] = True
        async with sem:
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
                    elif first is None and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter()
            e2e.append(time.perf_counter() - t0)
            ttft.append((first or time.perf_counter()) - t0)

    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return {
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttft),
        "e2e_p50_s": statistics.median(e2e),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-serve", action="store_true", help="only the mask cost")
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1:
        print("bench_grammar: --requests and --concurrency must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print("mask cost per decode step (constrained rows, mid-string):")
    mask_cost("tiny", TinyTokenizer(1024).vocab_spec(), b'{"city":"Par')
    for size in (32_000, 128_000):
        for batch in (8, 32):
            mask_cost(f"synthetic {size // 1000}K", synthetic_vocab(size), b'{"city":"Par', batch)
    if args.skip_serve:
        return 0
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--port",
            str(port),
            "--preset",
            "tiny-1p1d",
            "--kv-root",
            str(Path(tmp) / "kv"),
        ]
        log = open(Path(tmp) / "serve.log", "wb")  # noqa: SIM115 - closed with the server
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.close()
                    print((Path(tmp) / "serve.log").read_text(), file=sys.stderr)
                    print("bench_grammar: the server did not start", file=sys.stderr)
                    return 1
                time.sleep(0.3)
            print(f"\nserved ({args.requests} requests, {args.concurrency} at once, tiny-1p1d):")
            for constrained in (False, True, False, True):
                r = asyncio.run(served(url, args.requests, args.concurrency, constrained))
                label = "json_schema" if constrained else "free text  "
                print(
                    f"  {label}: {r['tokens_per_s']:7.1f} output tok/s ({r['tokens']} tokens "
                    f"in {r['wall_s']:.1f} s), TTFT p50 {r['ttft_p50_s'] * 1e3:6.0f} ms, "
                    f"request p50 {r['e2e_p50_s']:.2f} s"
                )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    return 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
