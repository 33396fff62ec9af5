"""Where one request's time goes in our engine: every hop from HTTP to SSE, measured.

Run: .venv/bin/python benchmarks/bench_latency.py [--turns 12 --agents 2 --max-gen 32] [--vllm]

Writes a tiny random Llama checkpoint (4 layers, hidden 256, as bench_peer / bench_vllm), starts
`dualpath serve` on it (SNIC unpaced: --snic-mb-per-s 100000) with ``DUALPATH_HOPS`` set, so
every process stamps each hop of a request (``metrics/hops.py``: one host-wide monotonic
clock), and replays design §9 agents at concurrency 1 (one request in flight: each request's
hops are the stamps between its ``http.request`` and the next). Prints, per hop, the median
time since the request arrived and since the hop before (the TTFT path: HTTP → backend →
scheduler host → scheduler → storage worker → PE → scheduler → host → backend → SSE), the
decode path (hand-off to the DE, its steps, each token's way from the DE step to its SSE
chunk) and the end (last step → done → SSE). With ``--vllm`` the same requests go to plain
vLLM (`.venv-vllm`) too, and its client-side TTFT / TPOT print beside ours.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
from pathlib import Path
from typing import Any

from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions
from dualpath.metrics import hops
from dualpath.workload.scripts import chat_scripts
from servers import dualpath_serve, plain_vllm, tiny_llama  # benchmarks/servers.py

# the TTFT path, in the order a request passes it (first stamp of each after the arrival)
TTFT_PATH = (
    "http.request",
    "backend.submit",
    "host.command",
    "sched.submit",
    "sched.assigned",
    "sched.read_sent",
    "storage.read",
    "storage.read_done",
    "sched.read_done",
    "sched.pass_sent",
    "pe.pass",
    "pe.layers_done",
    "pe.done",
    "sched.first_token",
    "host.tokens",
    "backend.relay",
    "backend.event",
    "http.sse",
)
DECODE_PATH = (
    "sched.first_token",
    "sched.decode_sent",
    "de.received",
    "de.loaded",
    "de.admitted",
    "de.step",
)


def _requests(stamps: list[tuple[float, str, int]]) -> list[list[tuple[float, str]]]:
    """The stamps split per request (concurrency 1: a request runs from its http.request to
    the next one's)."""
    out: list[list[tuple[float, str]]] = []
    for t, name, _ in stamps:
        if name == "http.request":
            out.append([])
        if out:
            out[-1].append((t, name))
    return out


def _first(req: list[tuple[float, str]], name: str, after: float) -> float | None:
    return next((t for t, n in req if n == name and t >= after), None)


def breakdown(stamps: list[tuple[float, str, int]], skip: int) -> dict[str, Any]:
    """Median ms per hop over the requests after the first ``skip`` (warm-up)."""
    reqs = [r for r in _requests(stamps)[skip:] if any(n == "de.step" for _, n in r)]
    ttft: dict[str, list[float]] = {}
    decode: dict[str, list[float]] = {}
    step_gap: list[float] = []  # DE step to the next DE step
    token_lag: list[float] = []  # DE step to the SSE chunk of its token
    tail: dict[str, list[float]] = {}
    read = 0
    for r in reqs:
        t0 = prev = r[0][0]
        for name in TTFT_PATH:
            t = _first(r, name, prev)
            if t is None:
                continue  # (no read: a turn without hits)
            if name == "storage.read":
                read += 1
            ttft.setdefault(name, []).append((t - t0) * 1e3)
            prev = t
        prev = _first(r, "sched.first_token", t0) or t0
        for name in DECODE_PATH[1:]:
            t = _first(r, name, prev)
            if t is not None:
                decode.setdefault(name, []).append((t - prev) * 1e3)
                prev = t
        steps = [t for t, n in r if n == "de.step"]
        sses = [t for t, n in r if n == "http.sse"][1:]  # (the first is the PE's token)
        step_gap += [(b - a) * 1e3 for a, b in itertools.pairwise(steps)]
        for t in sses:  # each chunk against the last DE step before it (its newest token)
            before = [d for d in steps if d <= t]
            if before:
                token_lag.append((t - before[-1]) * 1e3)
        last_step = steps[-1]
        done = _first(r, "sched.decode_done", last_step)
        if done is not None:
            tail.setdefault("sched.decode_done", []).append((done - last_step) * 1e3)
            durable = _first(r, "sched.durable", done)
            if durable is not None:
                tail.setdefault("sched.durable", []).append((durable - done) * 1e3)
        if sses:
            tail.setdefault("last http.sse", []).append((sses[-1] - last_step) * 1e3)
    med = statistics.median
    return {
        "requests": len(reqs),
        "with_read": read,
        "ttft_ms": {k: med(v) for k, v in ttft.items()},
        "decode_ms": {k: med(v) for k, v in decode.items()},
        "step_gap_ms": med(step_gap) if step_gap else 0.0,
        "token_lag_ms": med(token_lag) if token_lag else 0.0,
        "tail_ms": {k: med(v) for k, v in tail.items()},
    }


def _drive(url: str, scripts: Any, model: str) -> dict[str, Any]:
    gen = LoadGenerator(LoadgenOptions(url, model=model, concurrency=1))
    return asyncio.run(gen.run(scripts)).summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--token-scale", type=float, default=0.05)
    ap.add_argument("--max-gen", type=int, default=32)
    ap.add_argument("--vllm", action="store_true", help="also time plain vLLM on the same load")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `dualpath serve` args")
    args = ap.parse_args()
    scripts = chat_scripts(args.agents, args.turns, args.token_scale, args.max_gen, 32, seed=0)
    warm = chat_scripts(1, 2, args.token_scale, 8, 32, seed=99)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp))
        hop_dir = Path(tmp) / "hops"
        hop_dir.mkdir()
        serve_args = ["--snic-mb-per-s", "100000", *args.serve_arg]
        with dualpath_serve(
            ckpt, Path(tmp) / "kv", Path(tmp) / "serve.log", serve_args, {hops.ENV: str(hop_dir)}
        ) as server:
            ready = server.ready_s
            _drive(server.url, warm, ckpt.name)
            ours = _drive(server.url, scripts, ckpt.name)
        b = breakdown(hops.read(str(hop_dir)), skip=2)
        peer = None
        if args.vllm:
            with plain_vllm(ckpt, Path(tmp) / "vllm.log") as vllm:
                _drive(vllm.url, warm, ckpt.name)
                peer = _drive(vllm.url, scripts, ckpt.name)
    print(
        f"dualpath serve ready in {ready:.1f} s; {b['requests']} requests at concurrency 1 "
        f"({b['with_read']} with a store read), medians:"
    )
    print(f"{'TTFT path':<22}{'since arrival':>14}{'this hop':>10}")
    prev = 0.0
    for name, t in sorted(b["ttft_ms"].items(), key=lambda kv: kv[1]):
        print(f"  {name:<20}{t:11.2f} ms{t - prev:7.2f} ms")
        prev = t
    print("decode path (each hop since the one before):")
    for name, t in b["decode_ms"].items():
        print(f"  {name:<20}{t:11.2f} ms")
    print(
        f"  DE step to next step {b['step_gap_ms']:9.2f} ms;  chunk after its DE step "
        f"{b['token_lag_ms']:.2f} ms"
    )
    print("end (since the last DE step):")
    for name, t in b["tail_ms"].items():
        print(f"  {name:<20}{t:11.2f} ms")
    ms = 1e3
    print(
        f"client: TTFT p50 {ours['ttft_s']['p50'] * ms:.1f} ms  TPOT p50 "
        f"{ours['tpot_s']['p50'] * ms:.1f} ms  ITL p50 {ours['itl_s']['p50'] * ms:.1f} ms"
    )
    if peer is not None:
        print(
            f"vLLM  : TTFT p50 {peer['ttft_s']['p50'] * ms:.1f} ms  TPOT p50 "
            f"{peer['tpot_s']['p50'] * ms:.1f} ms  ITL p50 {peer['itl_s']['p50'] * ms:.1f} ms"
        )


if __name__ == "__main__":
    main()
