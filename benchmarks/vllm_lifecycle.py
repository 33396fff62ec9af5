"""DualPath inside vLLM under vLLM's whole request lifecycle: preemption and aborted streams,
checked against one plain vLLM instance on the same checkpoint.

Run: .venv/bin/python benchmarks/vllm_lifecycle.py [--sessions 24 --turns 3 --cycles 10]

On 127.0.0.1, with a tiny random Llama (4 layers, hidden 256, head_dim 64), float32, greedy:

1. preemption: ``--sessions`` chats of ``--turns`` turns each, all sessions at once, prompts
   of about 1,150 to 2,750 tokens, 64 tokens an answer (``ignore_eos``), through
   ``dualpath serve --engine vllm`` whose instances have only ``--blocks`` KV blocks (vLLM
   preempts), and through plain vLLM: how many answers are equal, and the decode instance's
   ``vllm:num_preemptions_total``; then the minimal case (two concurrent ~2,400-token chats,
   300 tokens each) on a fresh deployment;
2. aborts: ``--cycles`` cycles of 20 streams, half closed before their first byte and half
   right after it; after each cycle the DE buffer's free slots (``/metrics``) against their
   value at the start, then 20 new requests, each of which must be answered.

Prints each figure; exits 1 if an answer differs, no preemption happened, a slot leaked or a
request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from servers import Server, dualpath_serve, plain_vllm, tiny_llama

_VOCAB = """agent tool call observation test file repository function bug fix error trace assert
list summary layout read write run patch diff commit branch module class return value print
hello world import python source main loop cache block"""
WORDS = tuple(_VOCAB.split())


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def sessions(n: int, seed: int) -> list[list[str]]:
    """Per session, the new text of each turn (the first is long, the others append)."""
    rng = random.Random(seed)
    return [
        [text(rng, rng.randint(370, 600))] + [text(rng, rng.randint(80, 150)) for _ in range(4)]
        for _ in range(n)
    ]


async def complete(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = await client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
    return str(r.json()["choices"][0]["text"])


async def chats(
    url: str, model: str, script: list[list[str]], turns: int, max_tokens: int
) -> dict[tuple[int, int], str]:
    """Every session at once, its turns in order: (session, turn) → answer."""
    out: dict[tuple[int, int], str] = {}
    async with httpx.AsyncClient(timeout=1200) as client:

        async def one(s: int) -> None:
            prompt = ""
            for t in range(turns):
                prompt += script[s][t] + " "
                answer = await complete(client, url, model, prompt, max_tokens)
                out[(s, t)] = answer
                prompt += answer + " "

        await asyncio.gather(*(one(s) for s in range(len(script))))
    return out


def metric(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def instance_urls(log_dir: Path) -> dict[str, str]:
    """node → URL of each vLLM instance of a deployment (``processes.json``)."""
    urls: dict[str, str] = json.loads((log_dir / "processes.json").read_text())["urls"]
    return urls


def preemptions(log_dir: Path) -> float:
    return sum(metric(u, "vllm:num_preemptions_total") for u in instance_urls(log_dir).values())


def serve(ckpt: Path, work: Path, name: str, blocks: int) -> tuple[Server, Path]:
    logs = work / name
    logs.mkdir()
    args = [
        "--engine",
        "vllm",
        "--dtype",
        "float32",
        "--vllm-log-dir",
        str(logs),
        f"--vllm-arg=--num-gpu-blocks-override={blocks}",
    ]
    return dualpath_serve(ckpt, work / f"kv-{name}", logs / "serve.log", args), logs


async def abort_cycle(url: str, model: str, rng: random.Random) -> None:
    """20 streams: half closed before their first byte, half right after it."""

    async def one(i: int) -> None:
        body = {
            "model": model,
            "prompt": text(rng, rng.randint(100, 300)),
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(timeout=600) as client:
            if i % 2 == 0:  # gone before a byte comes back
                task = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
                await asyncio.sleep(0.05 + 0.01 * i)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    break  # gone after the first bytes

    await asyncio.gather(*(one(i) for i in range(20)))


def free_de_slots(url: str) -> float:
    return metric(url, "dualpath:buffer_free_slots", 'node="1"')


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--blocks", type=int, default=160, help="KV blocks of each instance")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of parts to skip: preempt,minimal,abort")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    failed = False
    with tempfile.TemporaryDirectory(prefix="vllm-lifecycle-") as tmp:
        work = Path(tmp)
        ckpt = tiny_llama(work)
        model = ckpt.name
        script = sessions(args.sessions, args.seed)
        two = [[text(random.Random(100 + i), 750)] for i in range(2)]  # ~2,400 tokens
        with plain_vllm(ckpt, work / "plain.log") as ref:
            want = asyncio.run(chats(ref.url, model, script, args.turns, 64))
            want_two = asyncio.run(chats(ref.url, model, two, 1, 300))
        if "preempt" not in skip:
            srv, logs = serve(ckpt, work, "preempt", args.blocks)
            with srv:
                t0 = time.monotonic()
                got = asyncio.run(chats(srv.url, model, script, args.turns, 64))
                took = time.monotonic() - t0
                n_pre = preemptions(logs)
            same = sum(got[k] == want[k] for k in want)
            print(
                f"preemption: {same}/{len(want)} answers equal plain vLLM's, "
                f"{n_pre:.0f} preemptions, {took:.1f} s"
            )
            failed |= same != len(want) or n_pre == 0
        if "minimal" not in skip:
            srv, logs = serve(ckpt, work, "minimal", args.blocks)
            with srv:
                got = asyncio.run(chats(srv.url, model, two, 1, 300))
                n_pre = preemptions(logs)
            same = sum(got[k] == want_two[k] for k in want_two)
            print(f"minimal: {same}/2 answers equal, {n_pre:.0f} preemptions")
            failed |= same != 2 or n_pre == 0
        if "abort" not in skip:
            srv, logs = serve(ckpt, work, "abort", 4096)
            with srv:
                rng = random.Random(args.seed + 7)
                start = metric(srv.url, "dualpath:buffer_slots", 'node="1"')  # all free
                for c in range(args.cycles):
                    asyncio.run(abort_cycle(srv.url, model, rng))
                    deadline = time.monotonic() + 120  # aborted requests drain
                    while free_de_slots(srv.url) != start and time.monotonic() < deadline:
                        time.sleep(0.5)
                    free = free_de_slots(srv.url)

                    async def twenty() -> list[Any]:
                        async with httpx.AsyncClient(timeout=600) as client:
                            return await asyncio.gather(
                                *(
                                    complete(client, srv.url, model, text(rng, 200), 16)
                                    for _ in range(20)
                                ),
                                return_exceptions=True,
                            )

                    answered = sum(isinstance(a, str) for a in asyncio.run(twenty()))
                    print(
                        f"abort cycle {c + 1}: DE free slots {free:.0f} (start {start:.0f}), "
                        f"{answered}/20 new requests answered",
                        flush=True,
                    )
                    failed |= free != start or answered != 20
    print("FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
