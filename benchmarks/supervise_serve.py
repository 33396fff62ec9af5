"""SIGKILL the processes of a real `dualpath serve` at chosen moments; every answer checked
against a fault-free run, the server checked still serving.

Run: .venv/bin/python benchmarks/supervise_serve.py MODE [--kills 10 ...]
- ``forkserver``: ``--kills`` rounds of ``--streams`` greedy streams (``ignore_eos``,
  ``--max-tokens`` each); in each, once every stream has its first tokens, the fork server the
  runtime's children fork from is SIGKILLed. Its children serve on; a new one is started.
- ``storage-read``: the SNIC slowed (``--snic-mb-per-s``) so that reading a cached prompt's
  blocks takes seconds; in each of ``--kills`` rounds a long prompt is answered (its blocks
  persisted), then sent again, and the storage worker whose read queue holds its hit tokens
  (``/metrics``) is SIGKILLed inside that read. The scheduler re-issues it to the successor.
- ``kinds``: one server, one kill of each kind: the fork server idle, the fork server during
  streams, a storage worker inside a read, a PE and a DE during streams.

The fault-free answers come from a first server with no faults (same preset, fresh store),
stopped before the faulty one starts (they never share the CPUs). An answer must equal its
fault-free one token for token (greedy); a clean error counts apart (none expected). After
each kill ``/health`` is polled: the time it stayed non-200 (recovering) and whether it was
200 again within ``--recover-s`` are reported. Exit 0 only when every answer is equal and
the server served after every kill. ``--out`` writes the report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_serve import Server, roles

HEALTH_POLL_S = 0.01


@dataclass(slots=True)
class Kill:
    """One SIGKILL and what followed it."""

    case: str  # forkserver-idle, forkserver-streams, storage-read, pe, de
    pid: int
    answers: int = 0  # answers checked for this kill
    equal: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: int = 0
    not_ready_s: float = 0.0  # how long /health was not 200 after the kill
    saw_not_ready: bool = False  # /health was seen not 200 (it may be too short to see)
    serving: bool = False  # /health 200 again within --recover-s and the server alive
    read_in_flight: bool | None = None  # storage-read: the kill came while the read ran


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("forkserver", "storage-read", "kinds"))
    ap.add_argument("--kills", type=int, default=10, help="rounds, one kill each (default 10)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    ap.add_argument("--max-tokens", type=int, default=48, help="output tokens per answer")
    ap.add_argument("--preset", default="tiny-1p1d")
    ap.add_argument("--system", default="dualpath")
    ap.add_argument(
        "--snic-mb-per-s",
        type=float,
        default=2.0,
        help="storage-read, kinds: the slowed SNIC (default 2 MB/s)",
    )
    ap.add_argument(
        "--prompt-words",
        type=int,
        default=400,
        help="storage-read: words of each long prompt (~4 tokens each)",
    )
    ap.add_argument(
        "--not-ready-wait-s",
        type=float,
        default=2.0,
        help="after a kill, watch /health this long for a not-ready answer",
    )
    ap.add_argument("--recover-s", type=float, default=30.0, help="/health 200 within this")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--out", help="write the report as JSON to this file")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ requests
def prompt(tag: str, words: int) -> str:
    """A deterministic prompt, distinct per ``tag``."""
    seed = sum(map(ord, tag)) * 7919
    return f"{tag}: " + " ".join(str((seed + i * 104729) % 100000) for i in range(words))


async def complete(
    url: str, text: str, args: argparse.Namespace, started: asyncio.Event | None = None
) -> tuple[list[int], str]:
    """(output token ids, "" or the error) of one greedy streamed completion; ``started`` is
    set at its first tokens."""
    import httpx

    body = {
        "model": "dualpath-tiny",
        "prompt": text,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    try:
        async with (
            httpx.AsyncClient(timeout=args.request_timeout_s + 30) as c,
            c.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            if r.status_code != 200:
                return ids, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return ids, f"error event: {chunk['error']}"
                for choice in chunk.get("choices", []):
                    ids += choice.get("token_ids") or []
                if ids and started is not None:
                    started.set()
    except httpx.HTTPError as err:
        return ids, f"{type(err).__name__}: {err}"
    if len(ids) != args.max_tokens:
        return ids, f"{len(ids)} tokens, expected {args.max_tokens}"
    return ids, ""


async def streams(
    url: str, texts: list[str], args: argparse.Namespace, then: Any = None
) -> list[tuple[list[int], str]]:
    """Answer ``texts`` concurrently; ``then()`` (a coroutine function) runs once every
    stream has its first tokens."""
    flags = [asyncio.Event() for _ in texts]
    tasks = [
        asyncio.create_task(complete(url, t, args, f)) for t, f in zip(texts, flags, strict=True)
    ]
    if then is not None:
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), args.recover_s)
        await then()
    return list(await asyncio.gather(*tasks))


# ------------------------------------------------------------------ processes and health
def pid_of(server: Server, role: str, name: str = "") -> int:
    """The server's process of ``role`` (whose /proc comm starts with ``name``, if given)."""
    for pid, r in sorted(roles(server.proc.pid).items()):
        if r == role and Path(f"/proc/{pid}/comm").read_text().startswith(name):
            return pid
    raise RuntimeError(f"no {role} {name} process")


async def recovered(server: Server, kill: Kill, args: argparse.Namespace, since: float) -> None:
    """Poll /health: until it is not 200 (recovering; at most ``--not-ready-wait-s``: a fork
    server's restart may be over before a poll sees it), then until it is 200 again
    (``kill.serving``), timing how long it was not."""
    import httpx

    first_bad = None
    async with httpx.AsyncClient(timeout=2.0) as c:
        while time.monotonic() - since < args.recover_s and server.proc.poll() is None:
            try:
                ok = (await c.get(server.url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            now = time.monotonic()
            if not ok and first_bad is None:
                first_bad = now
                kill.saw_not_ready = True
            if ok and (first_bad is not None or now - since > args.not_ready_wait_s):
                kill.not_ready_s = round(now - first_bad, 3) if first_bad is not None else 0.0
                kill.serving = server.proc.poll() is None
                return
            await asyncio.sleep(HEALTH_POLL_S)


async def metric(server: Server, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples (those whose labels contain ``label``) in /metrics."""
    import httpx

    async with httpx.AsyncClient(timeout=2.0) as c:
        text = (await c.get(server.url + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def read_node(server: Server, timeout_s: float) -> int | None:
    """The node whose storage read queue holds tokens (a read in flight), or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in (0, 1):
            if await metric(server, "dualpath:queue_length", f"read_node{node}_tokens") > 0:
                return node
        await asyncio.sleep(0.02)
    return None


def check(kill: Kill, got: list[tuple[list[int], str]], want: list[list[int]]) -> None:
    for (ids, err), ref in zip(got, want, strict=True):
        kill.answers += 1
        if err:
            kill.errors.append(err[:300])
        elif ids == ref:
            kill.equal += 1
        else:
            kill.mismatches += 1


# ------------------------------------------------------------------ the cases
async def kill_during_streams(
    server: Server,
    case: str,
    role: str,
    name: str,
    texts: list[str],
    want: list[list[int]],
    args: argparse.Namespace,
) -> Kill:
    kill = Kill(case, 0)

    async def strike() -> None:
        kill.pid = pid_of(server, role, name)
        os.kill(kill.pid, signal.SIGKILL)
        await recovered(server, kill, args, time.monotonic())

    check(kill, await streams(server.url, texts, args, strike), want)
    return kill


async def kill_idle_forkserver(
    server: Server, texts: list[str], want: list[list[int]], args: argparse.Namespace
) -> Kill:
    kill = Kill("forkserver-idle", pid_of(server, "forkserver"))
    os.kill(kill.pid, signal.SIGKILL)
    await recovered(server, kill, args, time.monotonic())
    check(kill, await streams(server.url, texts, args), want)
    return kill


async def kill_inside_read(
    server: Server, text: str, want: list[int], args: argparse.Namespace
) -> Kill:
    """``text`` was answered before (its blocks are in the store): send it again and kill the
    storage worker that reads its blocks while it reads them."""
    kill = Kill("storage-read", 0)
    requeued = await metric(server, "dualpath:num_preemptions_total")
    # /metrics lags the runtime by up to 0.5 s: an earlier read must have left it first
    deadline = time.monotonic() + args.recover_s
    while await metric(server, "dualpath:queue_length", "read_node") > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("a storage read queue never emptied")
        await asyncio.sleep(0.05)
    task = asyncio.create_task(complete(server.url, text, args))
    node = await read_node(server, args.recover_s)
    if node is not None:
        kill.pid = pid_of(server, "storage", f"storage@node{node}")
        os.kill(kill.pid, signal.SIGKILL)
        await recovered(server, kill, args, time.monotonic())
    check(kill, [await task], [want])
    # a read that was in flight is re-issued to the successor (counted as a requeue)
    kill.read_in_flight = await metric(server, "dualpath:num_preemptions_total") > requeued
    return kill


# ------------------------------------------------------------------ driver
def texts_for(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every prompt the run sends, by round (the fault-free server answers them all first)."""
    short = max(8, args.prompt_words // 20)
    out: dict[str, list[str]] = {}
    if args.mode == "forkserver":
        for k in range(args.kills):
            out[f"fs{k}"] = [prompt(f"fs{k}.{i}", short) for i in range(args.streams)]
    elif args.mode == "storage-read":
        for k in range(args.kills):
            out[f"read{k}"] = [prompt(f"read{k}", args.prompt_words)]
    else:
        n = min(args.streams, 4)
        for case in ("forkserver-idle", "forkserver-streams", "pe", "de"):
            out[case] = [prompt(f"{case}.{i}", short) for i in range(n)]
        out["storage-read"] = [prompt("storage-read", args.prompt_words)]
    return out


def server_args(args: argparse.Namespace) -> tuple[str, ...]:
    slow = args.mode in ("storage-read", "kinds")
    return ("--snic-mb-per-s", str(args.snic_mb_per_s)) if slow else ()


async def answers(
    url: str, rounds: dict[str, list[str]], args: argparse.Namespace
) -> dict[str, list[list[int]]]:
    """Every prompt of ``rounds`` answered (no fault meanwhile): the reference."""
    out = {}
    for key, texts in rounds.items():
        got = await streams(url, texts, args)
        bad = [err for _, err in got if err]
        if bad:
            raise RuntimeError(f"the fault-free run failed: {bad[0]}")
        out[key] = [ids for ids, _ in got]
    return out


async def kill_rounds(
    server: Server,
    rounds: dict[str, list[str]],
    want: dict[str, list[list[int]]],
    args: argparse.Namespace,
    persisted: bool = False,
) -> list[Kill]:
    """One kill per round (``args.mode``; ``kinds``: the round's key names it). ``persisted``:
    this server answered every prompt before (the reference: its blocks are stored)."""
    kills: list[Kill] = []
    for key, texts in rounds.items():
        case = key if args.mode == "kinds" else args.mode
        if case == "storage-read":
            if not persisted:
                await streams(server.url, texts, args)  # answered once: blocks persisted
            kills.append(await kill_inside_read(server, texts[0], want[key][0], args))
        elif case == "forkserver-idle":
            kills.append(await kill_idle_forkserver(server, texts, want[key], args))
        elif case in ("forkserver", "forkserver-streams"):
            kills.append(
                await kill_during_streams(
                    server, "forkserver-streams", "forkserver", "", texts, want[key], args
                )
            )
        else:  # a PE or a DE during streams
            kills.append(
                await kill_during_streams(server, case, "engine", case, texts, want[key], args)
            )
        k = kills[-1]
        print(
            f"supervise: {k.case} pid {k.pid}: {k.equal}/{k.answers} equal, "
            f"{len(k.errors)} errors, /health not 200 for {k.not_ready_s:.3f} s, "
            f"serving {k.serving}",
            file=sys.stderr,
            flush=True,
        )
    return kills


async def two_servers(args: argparse.Namespace, tmp: Path) -> tuple[list[Kill], int]:
    """The fault-free server answers every round, then the faulty one (fresh store) gets the
    kills; returns them and the faulty server's exit code after a stop."""
    rounds = texts_for(args)
    ref = Server(args, tmp / "kv-ref", tmp / "reference.log", server_args(args))
    try:
        await asyncio.to_thread(ref.wait_ready)
        want = await answers(ref.url, rounds, args)
    finally:
        ref.stop()
    server = Server(args, tmp / "kv", tmp / "server.log", server_args(args))
    try:
        await asyncio.to_thread(server.wait_ready)
        kills = await kill_rounds(server, rounds, want, args)
    finally:
        code = server.stop()
    return kills, code


def summary(kills: list[Kill], code: int) -> dict[str, Any]:
    return {
        "kills": len(kills),
        "answers": sum(k.answers for k in kills),
        "equal": sum(k.equal for k in kills),
        "errors": sum(len(k.errors) for k in kills),
        "mismatches": sum(k.mismatches for k in kills),
        "serving_after_every_kill": all(k.serving for k in kills),
        "reads_in_flight": sum(bool(k.read_in_flight) for k in kills),
        "not_ready_s_max": max((k.not_ready_s for k in kills), default=0.0),
        "not_ready_seen": sum(k.saw_not_ready for k in kills),
        "server_exit_code": code,
        "by_kill": [asdict(k) for k in kills],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="supervise-") as tmp:
        kills, code = asyncio.run(two_servers(args, Path(tmp)))
    return summary(kills, code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    s = run(args)
    print(
        f"supervise {args.mode}: {s['kills']} kills, {s['equal']}/{s['answers']} answers equal "
        f"to the fault-free run, {s['errors']} errors, {s['mismatches']} mismatches, serving "
        f"after every kill: {s['serving_after_every_kill']}, /health not 200 at most "
        f"{s['not_ready_s_max']:.3f} s, server exit {s['server_exit_code']}, "
        f"{time.monotonic() - t0:.0f} s"
    )
    if args.mode != "forkserver":
        print(f"  storage kills inside a read: {s['reads_in_flight']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"options": vars(args), **s}, indent=1))
    good = s["equal"] == s["answers"] and s["serving_after_every_kill"]
    return 0 if good and s["server_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
