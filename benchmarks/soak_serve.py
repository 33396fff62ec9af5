"""Soak `dualpath serve` under injected faults; every answer checked against a fault-free server.

Run: .venv/bin/python benchmarks/soak_serve.py [--duration-s 600 --fault-every-s 30 ...]
Starts a real `dualpath serve` (the runtime: scheduler, storage workers, PE and DE engine
processes; default preset tiny-1p1d: 2 PEs, 2 DEs, 2 storage workers) on 127.0.0.1 with a
fresh KV store, and runs ``--sessions`` concurrent agent-like sessions through the official
``openai`` client: multi-turn chats that resend the whole growing conversation, greedy,
``ignore_eos`` (every answer is ``--max-tokens`` long), streaming and not in turn. Every
``--fault-every-s`` seconds one process of the server whose role is in ``--fault-roles``
(default: engine, storage; ``forkserver`` adds the fork server the runtime's children fork
from), drawn at random, gets SIGKILL or SIGSTOP (SIGCONT after 1–8 s; past the liveness
timeout the runtime kills it; the fork server only gets SIGKILL), found in the server's
process tree by the names the runtime gives its processes; the runtime respawns what died
(restarts a dead fork server, its children serving on) and requeues its requests.

Every request is sent again, with exactly the conversation it had, to a second server (fresh
store, no faults): ``--reference shadow`` (default) while the soak runs (both servers share the
CPUs: latencies include that), ``after`` once it is over (undisturbed latencies, twice the
time). Answers are compared by output token ids (the server's ``return_token_ids``); a
mismatch is checked offline (``classify``): where the reference model's two best logits at
the first differing token are within ``NEAR_TIE``, it is a float32 near-tie (a resumed turn
computes its prompt in other chunks than the reference: summation order), reported apart
from corrupted answers.

``--abuse`` adds hostile clients beside the sessions (the server must shrug them off):
``--slow-clients`` connections kept open with half-sent headers (reopened as the server
closes them), bodies shorter than their Content-Length, ``--malformed-per-s`` requests with
broken framing (each must get a 4xx in OpenAI's shape), a batch of requests with
10,000-property JSON schemas every ``--schema-every-s`` (each must be refused with a 400),
and one fault in three hits two processes at once (both storage workers, or one with an
engine). The report adds what each abuser saw and the server log's size.

Reports requests, errors, hung requests (past the server's ``--request-timeout-s``: a 504 /
timeout event or no answer at all), corrupted answers, latency p50/p90/p99 (end to end, and
TTFT of the streams), faults injected, and the RSS (VmRSS) of every server process sampled
every ``--rss-every-s`` (first → last, growth). One progress line every 10 s. Exit 0 only with
no error, no hang and no corrupted answer. ``--out`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROGRESS_S = 10.0
SETTLE_S = 15.0  # a runtime child younger than this without torch may be an engine starting
STOP_S = (1.0, 8.0)
FORKSERVER = "multiprocessing.forkserver import main"  # the fork server's command line  # SIGSTOP length, uniform: some resume, some are declared dead


# a mismatch where the reference model's two best logits are closer than this is float32
# summation order, not a wrong answer: a resumed turn (after a fault) computes its prompt in
# other chunks and batches than the reference server, and a near-tie argmax may flip (seen:
# a gap of 7e-7 at a logit of ~5). Checked offline per mismatch (``classify``).
NEAR_TIE = 1e-5


@dataclass(slots=True)
class Answer:
    session: int
    turn: int
    messages: list[dict[str, str]]
    stream: bool
    start_s: float  # since the soak began
    e2e_s: float
    ttft_s: float | None
    token_ids: list[int]
    outcome: str  # ok | error | hung
    detail: str = ""
    reference: list[int] | None = None
    tie_gap: float | None = None  # a mismatch: the reference's top-2 gap where they part


@dataclass(slots=True)
class Soak:
    """What the run saw; the sessions, the fault injector and the sampler all append here."""

    answers: list[Answer] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    rss: dict[int, dict[str, Any]] = field(default_factory=dict)  # pid → role, samples
    replay_queue: asyncio.Queue[Answer | None] | None = None
    abuse: dict[str, int] = field(default_factory=dict)  # what the hostile clients saw

    def count(self, what: str, n: int = 1) -> None:
        self.abuse[what] = self.abuse.get(what, 0) + n


# ------------------------------------------------------------------ options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="soak length (default 600)")
    ap.add_argument(
        "--fault-every-s", type=float, default=30.0, help="one fault every this often (0: none)"
    )
    ap.add_argument(
        "--fault-roles",
        default="engine,storage",
        help="roles faults hit: engine, storage, forkserver (comma-separated)",
    )
    ap.add_argument(
        "--fault-by-role",
        action="store_true",
        help="draw a role first, then one of its processes (default: a process)",
    )
    ap.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    ap.add_argument("--turns", type=int, default=10, help="turns before a session starts over")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per answer")
    ap.add_argument("--preset", default="tiny-1p1d", help="cluster preset (default tiny-1p1d)")
    ap.add_argument("--system", default="dualpath", help="basic, layer, dpl, dualpath, oracle")
    ap.add_argument(
        "--request-timeout-s",
        type=float,
        default=120.0,
        help="the server's --request-timeout-s (default 120)",
    )
    ap.add_argument("--reference", default="shadow", help="shadow (default) or after")
    ap.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampling period")
    ap.add_argument("--seed", type=int, default=0, help="faults and prompts")
    ap.add_argument("--out", help="write the report as JSON to this file")
    ab = ap.add_argument_group("abuse (--abuse)")
    ab.add_argument("--abuse", action="store_true", help="hostile clients beside the sessions")
    ab.add_argument(
        "--slow-clients",
        type=int,
        default=200,
        help="half-sent connections kept open (default 200)",
    )
    ab.add_argument(
        "--malformed-per-s",
        type=float,
        default=20.0,
        help="broken-framing requests per second (default 20)",
    )
    ab.add_argument(
        "--schema-every-s",
        type=float,
        default=5.0,
        help="a batch of 4 oversized-schema requests this often (default 5)",
    )
    args = ap.parse_args(argv)
    checks = [
        (args.duration_s > 0, "--duration-s", args.duration_s, "> 0"),
        (args.fault_every_s >= 0, "--fault-every-s", args.fault_every_s, ">= 0 (0: no faults)"),
        (args.sessions >= 1, "--sessions", args.sessions, ">= 1"),
        (args.turns >= 1, "--turns", args.turns, ">= 1"),
        (args.max_tokens >= 1, "--max-tokens", args.max_tokens, ">= 1"),
        (args.request_timeout_s > 0, "--request-timeout-s", args.request_timeout_s, "> 0"),
        (args.reference in ("shadow", "after"), "--reference", args.reference, "shadow or after"),
        (args.rss_every_s > 0, "--rss-every-s", args.rss_every_s, "> 0"),
        (args.slow_clients >= 0, "--slow-clients", args.slow_clients, ">= 0"),
        (args.malformed_per_s >= 0, "--malformed-per-s", args.malformed_per_s, ">= 0"),
        (args.schema_every_s > 0, "--schema-every-s", args.schema_every_s, "> 0"),
    ]
    for ok, name, value, allowed in checks:
        if not ok:
            ap.exit(2, f"soak_serve: {name} {value} is invalid: must be {allowed}\n")
    from dualpath.config.presets import CLUSTER_PRESETS
    from dualpath.config.systems import SYSTEMS

    if args.preset not in CLUSTER_PRESETS:
        known = ", ".join(sorted(CLUSTER_PRESETS))
        ap.exit(2, f"soak_serve: --preset {args.preset!r} is invalid: must be one of {known}\n")
    if args.system not in SYSTEMS:
        known = ", ".join(SYSTEMS)
        ap.exit(2, f"soak_serve: --system {args.system!r} is invalid: must be one of {known}\n")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        ap.exit(2, f"soak_serve: --out {args.out!r} is invalid: its folder does not exist\n")
    return args


# ------------------------------------------------------------------ servers and processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``dualpath serve`` on a free loopback port, its output in ``log``."""

    def __init__(
        self, args: argparse.Namespace, kv_root: Path, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--port",
            str(self.port),
            "--preset",
            args.preset,
            "--system",
            args.system,
            "--kv-root",
            str(kv_root),
            "--request-timeout-s",
            str(args.request_timeout_s),
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {tail}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"the server did not become ready in {timeout_s:g} s")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def roles(server_pid: int) -> dict[int, str]:
    """Every live process of the server by role, from the names the runtime gives its
    processes (``/proc/PID/comm``): http, scheduler, engine (pe… / de…), storage, forkserver
    (the scheduler's child running ``multiprocessing.forkserver``), other."""
    kids = _children()
    out = {server_pid: "http"}
    frontier = [server_pid]
    while frontier:
        parent = frontier.pop()
        for pid in sorted(kids.get(parent, [])):
            frontier.append(pid)
            name = _read(f"/proc/{pid}/comm").strip()
            if name == "dp-scheduler":
                out[pid] = "scheduler"
            elif name.startswith("storage@node"):
                out[pid] = "storage"
            elif re.fullmatch(r"(pe|de)\d+@node\d+", name):
                out[pid] = "engine"
            elif out.get(parent) == "scheduler" and FORKSERVER in _read(f"/proc/{pid}/cmdline"):
                out[pid] = "forkserver"
            else:
                out[pid] = "other"  # the resource tracker, a child starting
    return out


def _age_s(pid: int) -> float:
    """Seconds since process ``pid`` started (0 if it is gone)."""
    fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    if len(fields) < 20:
        return 0.0
    start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return float(_read("/proc/uptime").split()[0]) - start_s


def _rss_kib(pid: int) -> int | None:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


# ------------------------------------------------------------------ load
async def _ask(
    client: Any, messages: list[dict[str, str]], stream: bool, max_tokens: int, timeout_s: float
) -> tuple[list[int], float | None, str, str]:
    """(token ids, TTFT, outcome, detail) of one chat request."""
    import openai

    args: dict[str, Any] = {
        "model": "dualpath-tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    start = time.monotonic()
    ids: list[int] = []
    ttft = None
    try:
        if stream:
            async for chunk in await client.chat.completions.create(**args, stream=True):
                for c in chunk.choices:
                    new = (c.model_extra or {}).get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.monotonic() - start
                    ids += new
        else:
            r = await client.chat.completions.create(**args)
            ids = list((r.choices[0].model_extra or {}).get("token_ids") or [])
    except (TimeoutError, openai.APITimeoutError) as err:
        return ids, ttft, "hung", f"no answer in {timeout_s:g} s: {err}"
    except openai.APIError as err:
        text = str(err)
        status = getattr(err, "status_code", None)
        if status == 504 or "request_timeout_s" in text:
            return ids, ttft, "hung", text[:300]
        return ids, ttft, "error", f"{type(err).__name__}: {text[:300]}"
    except Exception as err:  # a cut connection, a protocol error: counted, not fatal
        return ids, ttft, "error", f"{type(err).__name__}: {str(err)[:300]}"
    if len(ids) != max_tokens:
        return ids, ttft, "error", f"{len(ids)} tokens, expected {max_tokens}"
    return ids, ttft, "ok", ""


async def session(
    i: int, client: Any, soak: Soak, args: argparse.Namespace, t0: float, end_s: float
) -> None:
    """Agent-like conversations: each turn appends a tool result and resends everything."""
    rng = random.Random(args.seed * 7919 + i)
    generation = 0
    while time.monotonic() - t0 < end_s:
        messages = [{"role": "system", "content": f"agent {i}.{generation}: " + "tool " * 30}]
        for turn in range(args.turns):
            if time.monotonic() - t0 >= end_s:
                return
            words = " ".join(str(rng.randrange(100000)) for _ in range(rng.randint(20, 60)))
            messages.append({"role": "user", "content": f"result {turn}: {words}"})
            stream = (i + turn) % 2 == 1
            start = time.monotonic()
            ids, ttft, outcome, detail = await _ask(
                client, list(messages), stream, args.max_tokens, args.request_timeout_s
            )
            a = Answer(
                i,
                turn,
                list(messages),
                stream,
                start - t0,
                time.monotonic() - start,
                ttft,
                ids,
                outcome,
                detail,
            )
            soak.answers.append(a)
            if outcome != "ok":
                break  # the conversation cannot go on: start a new one
            if soak.replay_queue is not None:
                soak.replay_queue.put_nowait(a)
            from dualpath.frontend.tokenizer import TinyTokenizer

            text = TinyTokenizer().decode(ids)
            messages.append({"role": "assistant", "content": text})
        generation += 1


async def faults(
    server_pid: int, soak: Soak, args: argparse.Namespace, t0: float, end_s: float
) -> None:
    rng = random.Random(args.seed)
    if not args.fault_every_s:
        return
    while True:
        await asyncio.sleep(args.fault_every_s)
        if time.monotonic() - t0 >= end_s:
            return
        wanted = set(args.fault_roles.split(","))
        targets = sorted((p, r) for p, r in roles(server_pid).items() if r in wanted)
        if not targets:
            continue
        if args.fault_by_role:  # (else a role is drawn as often as it has processes)
            role = rng.choice(sorted({r for _, r in targets}))
            targets_of_role = [t for t in targets if t[1] == role]
            pid, role = rng.choice(targets_of_role)
        else:
            pid, role = rng.choice(targets)
        kind = rng.choice(("kill", "stop", "double") if args.abuse else ("kill", "stop"))
        if role == "forkserver":
            kind = "kill"  # (stopped, it would only delay a respawn until it runs again)
        record: dict[str, Any] = {
            "t_s": round(time.monotonic() - t0, 1),
            "pid": pid,
            "role": role,
            "kind": kind,
        }
        try:
            if kind == "double":  # two at once: both storage workers, or one and an engine
                storage = [t for t in targets if t[1] == "storage"]
                pair = (
                    storage
                    if len(storage) == 2 and rng.random() < 0.5
                    else rng.sample(targets, min(2, len(targets)))
                )
                record.update(pid=[p for p, _ in pair], role="+".join(sorted(r for _, r in pair)))
                for p, _ in pair:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)
            elif kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                record["stop_s"] = stop_s = round(rng.uniform(*STOP_S), 1)
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(stop_s)
                with contextlib.suppress(ProcessLookupError):  # declared dead and killed
                    os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            record["missed"] = True  # it had just exited (a respawn in progress)
        soak.faults.append(record)


async def sample_rss(
    server_pid: int, soak: Soak, args: argparse.Namespace, t0: float, done: asyncio.Event
) -> None:
    while not done.is_set():
        now = round(time.monotonic() - t0, 1)
        for pid, role in roles(server_pid).items():
            kib = _rss_kib(pid)
            if kib is not None:
                entry = soak.rss.setdefault(pid, {"role": role, "samples": []})
                entry["role"] = role  # the latest: a respawned engine starts as "starting"
                entry["samples"].append((now, kib))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), args.rss_every_s)


# ------------------------------------------------------------------ hostile clients
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = (
    b"Content-Length: -5\r\n\r\n",
    b"Content-Length: 100000000000000000000000\r\n\r\n",
    b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhi\r\n0\r\n\r\n",
)


async def slow_clients(
    port: int, soak: Soak, args: argparse.Namespace, t0: float, end_s: float
) -> None:
    """Keep ``--slow-clients`` connections open with half-sent headers (one in four sends a
    body shorter than its Content-Length instead); count how the server ends them."""

    async def one(k: int) -> None:
        while time.monotonic() - t0 < end_s:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                soak.count("slow: connect refused")
                await asyncio.sleep(1.0)
                continue
            soak.count("slow: opened")
            lie = b"Content-Length: 1000\r\n\r\n0123456789" if k % 4 == 0 else b""
            writer.write(PARTIAL + lie)
            try:
                reply = await asyncio.wait_for(reader.read(200), end_s - (time.monotonic() - t0))
                status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "-"
                soak.count(f"slow: ended by the server ({status})")
            except (TimeoutError, OSError):
                soak.count("slow: still open at the end")
            finally:
                writer.close()

    await asyncio.gather(*(one(k) for k in range(args.slow_clients)))


async def malformed(
    port: int, soak: Soak, args: argparse.Namespace, t0: float, end_s: float
) -> None:
    """``--malformed-per-s`` requests with broken framing; each answer must be a 4xx with
    OpenAI's error shape."""
    if not args.malformed_per_s:
        return
    k = 0
    while time.monotonic() - t0 < end_s:
        await asyncio.sleep(1.0 / args.malformed_per_s)
        k += 1
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(PARTIAL + MALFORMED[k % len(MALFORMED)])
            reply = await asyncio.wait_for(reader.read(65536), 10)
            writer.close()
        except (TimeoutError, OSError) as err:
            soak.count(f"malformed: no answer ({type(err).__name__})")
            continue
        head, _, body = reply.partition(b"\r\n\r\n")
        shaped = False
        with contextlib.suppress(ValueError, KeyError, TypeError):
            shaped = set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        good = head[9:10] == b"4" and shaped
        soak.count("malformed: 4xx in OpenAI's shape" if good else "malformed: BAD ANSWER")


async def schema_flood(
    client: Any, soak: Soak, args: argparse.Namespace, t0: float, end_s: float
) -> None:
    """Every ``--schema-every-s``, four requests with distinct 10,000-property schemas."""
    import openai

    batch = 0
    while time.monotonic() - t0 < end_s:
        await asyncio.sleep(args.schema_every_s)
        batch += 1

        async def one(j: int, batch: int) -> None:
            props = {f"b{batch}_{j}_{i}": {"type": "string"} for i in range(10_000)}
            fmt = {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": props}},
            }
            try:
                await client.chat.completions.create(
                    model="dualpath-tiny",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=4,
                    response_format=fmt,
                )
                soak.count("schema: SERVED (expected a 400)")
            except openai.BadRequestError:
                soak.count("schema: 400")
            except Exception as err:
                soak.count(f"schema: {type(err).__name__}")

        await asyncio.gather(*(one(j, batch) for j in range(4)))


async def replay(url: str, soak: Soak, args: argparse.Namespace) -> None:
    """The reference: each answered request again on the fault-free server, per session in
    order (so its conversation's blocks are hits there too), sessions concurrently."""
    import openai

    assert soak.replay_queue is not None
    per_session: dict[int, asyncio.Queue[Answer | None]] = {}

    async def worker(q: asyncio.Queue[Answer | None], client: Any) -> None:
        while (a := await q.get()) is not None:
            ids, _, outcome, detail = await _ask(
                client, a.messages, False, args.max_tokens, args.request_timeout_s * 3
            )
            a.reference = ids if outcome == "ok" else None
            if outcome != "ok":
                a.detail += f" (reference failed: {detail})"

    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout_s * 3
    ) as client:
        workers = []
        while (a := await soak.replay_queue.get()) is not None:
            if a.session not in per_session:
                per_session[a.session] = asyncio.Queue()
                workers.append(asyncio.create_task(worker(per_session[a.session], client)))
            per_session[a.session].put_nowait(a)
        for q in per_session.values():
            q.put_nowait(None)
        await asyncio.gather(*workers)


async def progress(soak: Soak, t0: float, done: asyncio.Event) -> None:
    while not done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), PROGRESS_S)
        s = summary(soak, final=False)
        latest = max((e["samples"][-1][0] for e in soak.rss.values() if e["samples"]), default=0)
        rss = (
            sum(
                e["samples"][-1][1]
                for e in soak.rss.values()
                if e["samples"] and e["samples"][-1][0] == latest
            )
            / 1024
        )
        print(
            f"soak: t={time.monotonic() - t0:6.0f}s requests {s['requests']} ok {s['ok']} "
            f"errors {s['errors']} hung {s['hung']} checked {s['checked']} corrupted "
            f"{s['corrupted']} faults {len(soak.faults)} e2e p50 {s['e2e_s']['p50']:.2f}s "
            f"rss {rss:.0f} MiB (the live processes, last sample)",
            file=sys.stderr,
            flush=True,
        )


# ------------------------------------------------------------------ report
def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "n": 0}
    v = sorted(values)

    def at(q: float) -> float:
        return round(v[min(len(v) - 1, int(q * len(v)))], 4)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "n": len(v)}


def classify(soak: Soak, preset: str) -> None:
    """For each answer that differs from the reference: the reference model's gap between
    its two best logits at the first token where they part (greedy over the exact prompt,
    the reference's tokens before it; one thread, the preset's tiny model, seed 0)."""
    bad = [a for a in soak.answers if a.reference is not None and a.reference != a.token_ids]
    if not bad:
        return
    import torch

    from dualpath.config import preset as load_preset
    from dualpath.frontend.tokenizer import TinyTokenizer
    from dualpath.runtime.model import KVCache
    from dualpath.runtime.tiny import TinyTransformer

    torch.set_num_threads(1)
    model = TinyTransformer(load_preset(preset).model, seed=0)
    tok = TinyTokenizer(model.vocab_size)
    for a in bad:
        assert a.reference is not None
        at = next(
            k for k, (x, y) in enumerate(zip(a.token_ids, a.reference, strict=False)) if x != y
        )
        prompt = tok.encode(tok.render_chat(a.messages))
        cache = KVCache(model, len(prompt) + at + 1)
        logits = cache.extend(model, [*prompt, *a.reference[:at]])
        top = torch.topk(logits.float(), 2).values
        a.tie_gap = float(top[0] - top[1])


def summary(soak: Soak, final: bool = True) -> dict[str, Any]:
    answers = list(soak.answers)
    ok = [a for a in answers if a.outcome == "ok"]
    checked = [a for a in ok if a.reference is not None]
    mismatched = [a for a in checked if a.reference != a.token_ids]
    ties = [a for a in mismatched if a.tie_gap is not None and a.tie_gap < NEAR_TIE]
    corrupted = [a for a in mismatched if a not in ties]
    out: dict[str, Any] = {
        "requests": len(answers),
        "ok": len(ok),
        "errors": sum(a.outcome == "error" for a in answers),
        "hung": sum(a.outcome == "hung" for a in answers),
        "checked": len(checked),
        "unchecked": len(ok) - len(checked),
        "corrupted": len(corrupted),
        "near_ties": len(ties),
        "e2e_s": _pct([a.e2e_s for a in ok]),
        "ttft_s": _pct([a.ttft_s for a in ok if a.ttft_s is not None]),
    }
    if final:
        out["faults"] = {
            "injected": len(soak.faults),
            "by_kind": {
                k: sum(f"{f['role']} {f['kind']}" == k for f in soak.faults)
                for k in sorted({f"{f['role']} {f['kind']}" for f in soak.faults})
            },
        }
        out["failures"] = [
            {
                "session": a.session,
                "turn": a.turn,
                "t_s": round(a.start_s, 1),
                "outcome": a.outcome,
                "detail": a.detail,
            }
            for a in answers
            if a.outcome != "ok"
        ][:50]
        out["near_tie_examples"] = [
            {
                "session": a.session,
                "turn": a.turn,
                "gap": a.tie_gap,
                "got": a.token_ids,
                "want": a.reference,
            }
            for a in ties[:5]
        ]
        out["corrupted_examples"] = [
            {"session": a.session, "turn": a.turn, "got": a.token_ids, "want": a.reference}
            for a in corrupted[:5]
        ]
        out["rss_kib"] = rss_growth(soak)
    return out


def rss_growth(soak: Soak) -> list[dict[str, Any]]:
    rows = []
    for pid, e in sorted(soak.rss.items()):
        s = e["samples"]
        first, last = s[0], s[-1]
        rows.append(
            {
                "pid": pid,
                "role": e["role"],
                "first_t_s": first[0],
                "last_t_s": last[0],
                "first_kib": first[1],
                "last_kib": last[1],
                "max_kib": max(k for _, k in s),
                "growth_kib": last[1] - first[1],
                "samples": len(s),
            }
        )
    return rows


def print_report(s: dict[str, Any], args: argparse.Namespace, wall_s: float) -> None:
    print(
        f"soak: {args.duration_s:g} s, {args.sessions} sessions, preset {args.preset}, system "
        f"{args.system}, fault every {args.fault_every_s:g} s, reference {args.reference}, "
        f"wall {wall_s:.0f} s"
    )
    print(
        f"requests {s['requests']}  ok {s['ok']}  errors {s['errors']}  hung {s['hung']}  "
        f"checked {s['checked']}  unchecked {s['unchecked']}  corrupted {s['corrupted']}  "
        f"near-ties {s['near_ties']} (float32 order: the reference's top-2 gap < {NEAR_TIE:g})"
    )
    for t in s["near_tie_examples"]:
        print(f"  near-tie: session {t['session']} turn {t['turn']}, gap {t['gap']:.1e}")
    print(f"faults injected {s['faults']['injected']}: {s['faults']['by_kind']}")
    for name in ("e2e_s", "ttft_s"):
        p = s[name]
        print(f"{name:<7} p50 {p['p50']:.3f}  p90 {p['p90']:.3f}  p99 {p['p99']:.3f}  (n={p['n']})")
    print("RSS per process (KiB): pid role first → last (growth), max, over t_s")
    for r in s["rss_kib"]:
        print(
            f"  {r['pid']:>7} {r['role']:<16} {r['first_kib']:>8} → {r['last_kib']:>8} "
            f"({r['growth_kib']:+d}), max {r['max_kib']}, t {r['first_t_s']}–{r['last_t_s']}"
        )
    for f in s["failures"][:10]:
        print(f"  failure: {f}")


async def run(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], float]:
    import openai

    soak = Soak()
    server = Server(args, tmp / "kv", tmp / "server.log")
    ref = Server(args, tmp / "kv-ref", tmp / "reference.log")
    try:
        await asyncio.to_thread(server.wait_ready)
        await asyncio.to_thread(ref.wait_ready)
        t0 = time.monotonic()
        done = asyncio.Event()
        soak.replay_queue = asyncio.Queue()
        side = [
            asyncio.create_task(sample_rss(server.proc.pid, soak, args, t0, done)),
            asyncio.create_task(progress(soak, t0, done)),
        ]
        replayer = None
        if args.reference == "shadow":
            replayer = asyncio.create_task(replay(ref.url, soak, args))
        limit = httpx_timeout = args.request_timeout_s + 30  # past the server's own deadline
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=httpx_timeout
        ) as client:
            injector = asyncio.create_task(faults(server.proc.pid, soak, args, t0, args.duration_s))
            hostile = []
            if args.abuse:
                end = args.duration_s
                hostile = [
                    slow_clients(server.port, soak, args, t0, end),
                    malformed(server.port, soak, args, t0, end),
                    schema_flood(client, soak, args, t0, end),
                ]
            await asyncio.gather(
                *(
                    session(i, client, soak, args, t0, args.duration_s)
                    for i in range(args.sessions)
                ),
                *hostile,
            )
            injector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await injector
        done.set()
        await asyncio.gather(*side)
        soak.replay_queue.put_nowait(None)
        if replayer is None:
            replayer = asyncio.create_task(replay(ref.url, soak, args))
        await asyncio.wait_for(replayer, timeout=max(limit, args.duration_s * 2))
        wall = time.monotonic() - t0
    finally:
        codes = (server.stop(), ref.stop())
    classify(soak, args.preset)
    s = summary(soak)
    s["server_exit_codes"] = list(codes)
    log = (tmp / "server.log").read_text(errors="replace")
    s["server_log_bytes"] = (tmp / "server.log").stat().st_size
    s["abuse"] = dict(sorted(soak.abuse.items()))
    s["server_tracebacks"] = log.count("Traceback")
    s["server_log_tail"] = log[-3000:]
    s["answers"] = [asdict(a) | {"messages": len(a.messages)} for a in soak.answers]
    s["fault_log"] = soak.faults
    return s, wall


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        s, wall = asyncio.run(run(args, Path(tmp)))
    print_report(s, args, wall)
    print(
        f"server exit codes {s['server_exit_codes']}, tracebacks in its log "
        f"{s['server_tracebacks']}, log {s['server_log_bytes']} bytes"
    )
    for what, n in s["abuse"].items():
        print(f"  abuse: {what}: {n}")
    if args.out:
        report = {"options": vars(args), "wall_s": wall, **s}
        Path(args.out).write_text(json.dumps(report, indent=1))
    good = not (s["errors"] or s["hung"] or s["corrupted"] or s["unchecked"])
    good = good and not any("BAD" in k or "SERVED" in k for k in s["abuse"])
    return 0 if good and not s["server_tracebacks"] else 1


if __name__ == "__main__":
    sys.exit(main())
