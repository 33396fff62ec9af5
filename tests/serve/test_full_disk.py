"""A full disk under a real server: the KV root on a 5 MB tmpfs that this test
mounts, so block writes fail with a real ENOSPC. Every request (streaming or not, concurrent
multi-turn sessions resending their conversation) still ends in time with the answer of a
fault-free server on a fresh store, token for token; the dropped writes are counted, leave no
temporary file, and the server shuts down cleanly (no ``BufferError`` from a storage worker)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tests.procs import descendants, shm_used_by  # noqa: E402
from tests.serve.conftest import ServerProc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT_S = 30.0  # the server's --request-timeout-s: no request may take longer
NUM_SESSIONS = 6
NUM_TURNS = 3


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 5 MB tmpfs (about 19 of the tiny model's 260 KiB block files), unmounted after."""
    mnt = tmp_path / "kv"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small disk for the full-disk test")
    cmd = ["mount", "-t", "tmpfs", "-o", "size=5m,mode=0700", "tmpfs", str(mnt)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit {done.returncode}"
        pytest.skip(f"cannot mount a 5 MB tmpfs (needs root / CAP_SYS_ADMIN): {why}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@dataclass(frozen=True, slots=True)
class Answer:
    messages: tuple[tuple[str, str], ...]  # the conversation sent (role, content)
    stream: bool
    token_ids: tuple[int, ...]
    text: str
    finish: str | None
    took_s: float


async def _ask(
    client: openai.AsyncOpenAI, messages: tuple[tuple[str, str], ...], stream: bool
) -> Answer:
    body = [{"role": r, "content": c} for r, c in messages]
    args = {
        "model": "dualpath-tiny",
        "messages": body,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    start = time.monotonic()
    ids: list[int] = []
    text, finish = "", None
    if stream:
        async for chunk in await client.chat.completions.create(**args, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                ids += (c.model_extra or {}).get("token_ids", [])
                finish = c.finish_reason or finish
    else:
        r = await client.chat.completions.create(**args)
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        ids = (r.choices[0].model_extra or {})["token_ids"]
    return Answer(messages, stream, tuple(ids), text, finish, time.monotonic() - start)


async def _session(client: openai.AsyncOpenAI, i: int) -> list[Answer]:
    """A multi-turn conversation: each turn resends the whole of it (agent-like)."""
    messages: tuple[tuple[str, str], ...] = (("system", f"session {i}: " + "tool output " * 40),)
    out = []
    for turn in range(NUM_TURNS):
        ask = " ".join(str((i * 31 + turn * 17 + k) % 997) for k in range(50))
        messages = (*messages, ("user", ask))
        answer = await _ask(client, messages, stream=(i + turn) % 2 == 1)
        out.append(answer)
        messages = (*messages, ("assistant", answer.text))
    return out


def _client(server: ServerProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S + 30
    )


async def _sessions(server: ServerProc) -> list[Answer]:
    async with _client(server) as client:
        runs = await asyncio.gather(*(_session(client, i) for i in range(NUM_SESSIONS)))
    return [a for run in runs for a in run]


async def _replay(server: ServerProc, answers: list[Answer]) -> list[Answer]:
    """Each request again, with exactly the conversation it was sent."""
    async with _client(server) as client:
        return [await _ask(client, a.messages, a.stream) for a in answers]


def _server(kv: Path, log: Path) -> ServerProc:
    return ServerProc(
        [
            "--preset",
            "tiny-1p1d",
            "--kv-root",
            str(kv),
            "--hbm-tokens",
            "4096",
            "--request-timeout-s",
            str(TIMEOUT_S),
        ],
        log=log,
    )


def test_full_disk_answers_every_request_in_time_and_correctly(
    small_disk: Path, tmp_path: Path
) -> None:
    full = _server(small_disk, tmp_path / "full.log")
    try:
        procs = descendants(full.proc.pid)
        shm = shm_used_by(procs)
        answers = asyncio.run(_sessions(full))
        dropped = full.metric("dualpath:kv_persist_failed_blocks_total")
        cached = full.metric("dualpath:prefix_cache_hits_total")
    finally:
        code = full.stop()
    out = full.output()
    assert code == 0, out[-3000:]
    assert "Traceback" not in out and "BufferError" not in out, out[-3000:]
    assert dropped > 0  # the disk did fill up: writes failed with ENOSPC
    reported = [line for line in out.splitlines() if " not cached: " in line]
    assert reported and "No space left on device" in reported[0]
    assert len(reported) < 10  # named, never a flood (one line per 10 s at most)
    assert cached > 0  # the blocks that did fit are hits (and the answers below still agree)
    assert len(answers) == NUM_SESSIONS * NUM_TURNS
    assert all(a.finish in ("stop", "length") for a in answers)
    assert max(a.took_s for a in answers) < TIMEOUT_S  # nothing hung, nothing timed out
    assert [p.name for p in small_disk.rglob("*.tmp")] == []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f).exists() for f in shm):
        time.sleep(0.1)
    assert [f for f in shm if Path(f).exists()] == []

    ref = _server(tmp_path / "ref-kv", tmp_path / "ref.log")
    try:
        expected = asyncio.run(_replay(ref, answers))
    finally:
        with contextlib.suppress(Exception):
            ref.stop()
    assert [a.token_ids for a in answers] == [e.token_ids for e in expected]
    assert [a.text for a in answers] == [e.text for e in expected]
    assert all(a.token_ids for a in answers)
