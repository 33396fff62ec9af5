"""What hostile traffic costs an ordinary request: its latency beside each kind of abuse.

Run: .venv/bin/python benchmarks/bench_hostile.py [--reps 20 --max-tokens 16]
Starts one `dualpath serve` (tiny model) on loopback and times an unconstrained chat request
(``--max-tokens`` tokens, greedy, sequential, ``--reps`` times, the official ``openai``
client) while, in turn: nothing else runs; 200 half-sent connections are held open; 20
malformed requests a second arrive; four concurrent requests at a time carry distinct
10,000-property JSON schemas (refused by size); two at a time carry distinct valid
1,500-property schemas (each compiled by the server and by the engines: the "bounded share"
a constrained request may take from an unconstrained one). Each load runs in a process of its
own (its client's cost is not the timed client's). Prints p50 / p90 latency per case and its
ratio to the quiet case, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.servers import Server, _start

PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _schema(n: int, tag: str) -> dict[str, Any]:
    props = {f"{tag}{i}": {"type": "string", "maxLength": 4} for i in range(n)}
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "properties": props, "additionalProperties": False},
        },
    }


async def _slowloris(port: int, stop: asyncio.Event) -> None:
    conns = []
    for _ in range(200):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(PARTIAL)
        conns.append(w)
    await stop.wait()
    for w in conns:
        w.close()


async def _malformed(port: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(PARTIAL + b"Content-Length: -5\r\n\r\n")
            await r.read(4096)
            w.close()
        await asyncio.sleep(0.05)


def _schemas(client: Any, n: int, width: int, stop: asyncio.Event) -> Callable[[], Awaitable[None]]:
    async def flood() -> None:
        k = 0

        async def one(tag: str) -> None:
            with contextlib.suppress(Exception):  # refused (400) or served: both are the load
                await client.chat.completions.create(
                    model="dualpath-tiny",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=8,
                    response_format=_schema(n, tag),
                )

        while not stop.is_set():
            k += 1
            await asyncio.gather(*(one(f"s{k}_{j}_") for j in range(width)))

    return flood


async def _measure(client: Any, reps: int, max_tokens: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.monotonic()
        await client.chat.completions.create(
            model="dualpath-tiny",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=max_tokens,
            temperature=0,
        )
        out.append(time.monotonic() - t0)
    return out


CASES = (
    "quiet",
    "200 half-sent connections",
    "20 malformed requests/s",
    "4 x 10,000-property schemas (refused)",
    "2 x 1,500-property schemas (served)",
)


def _load(case: str, url: str, port: int, stop_flag: Any) -> None:
    """One load until ``stop_flag`` is set (in a process of its own)."""
    import openai

    async def main() -> None:
        stop = asyncio.Event()
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        loads: dict[str, Callable[[], Awaitable[None]]] = {
            CASES[1]: lambda: _slowloris(port, stop),
            CASES[2]: lambda: _malformed(port, stop),
            CASES[3]: _schemas(client, 10_000, 4, stop),
            CASES[4]: _schemas(client, 1_500, 2, stop),
        }
        task = asyncio.ensure_future(loads[case]())
        while not stop_flag.is_set():
            await asyncio.sleep(0.1)
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 60)

    asyncio.run(main())


async def run(args: argparse.Namespace, url: str, port: int) -> dict[str, list[float]]:
    import multiprocessing as mp

    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    results = {}
    await _measure(client, 3, args.max_tokens)  # warm
    ctx = mp.get_context("spawn")
    for case in CASES:
        flag = ctx.Event()
        proc = None
        if case != "quiet":
            proc = ctx.Process(target=_load, args=(case, url, port, flag))
            proc.start()
            await asyncio.sleep(3.0)  # the load process is up and loading
        results[case] = await _measure(client, args.reps, args.max_tokens)
        flag.set()
        if proc is not None:
            proc.join(60)
        print(f"  {case}: p50 {statistics.median(results[case]) * 1e3:.0f} ms", flush=True)
    await client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20, help="timed requests per case (default 20)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per timed request")
    args = ap.parse_args(argv)
    if args.reps < 2 or args.max_tokens < 1:
        ap.exit(2, "bench_hostile: --reps must be >= 2 and --max-tokens >= 1\n")
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        cmd = [sys.executable, "-m", "dualpath.cli.main", "serve", "--kv-root", f"{tmp}/kv"]
        server: Server = _start(cmd, Path(tmp) / "server.log")
        port = int(server.url.rsplit(":", 1)[1])
        try:
            results = asyncio.run(run(args, server.url, port))
        finally:
            server.stop()
    quiet = statistics.median(results["quiet"])
    print(
        f"\nan unconstrained {args.max_tokens}-token chat request, {args.reps} in a row, "
        "beside each load (same server, same run):"
    )
    print(f"{'load':<40} {'p50 ms':>8} {'p90 ms':>8} {'p50 / quiet':>12}")
    for name, xs in results.items():
        xs = sorted(xs)
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        med = statistics.median(xs)
        print(f"{name:<40} {med * 1e3:>8.0f} {p90 * 1e3:>8.0f} {med / quiet:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
