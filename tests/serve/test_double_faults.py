"""Several runtime processes SIGKILLed at once under a real server, mid-stream: both storage
workers, both storage workers and the DE, the PE and a storage worker. Ten two-turn streaming
sessions (the official ``openai`` client) each end within ``request_timeout_s`` with exactly
the text a fault-free server gives, or with a clean error — never a cut or doubled answer,
never a hang. Repeated at several points of the stream, where the race lived (a turn live
when its writes died with a worker was waited for until the timeout)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.procs import named
from tests.serve.conftest import ServerProc

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SESSIONS = 10
TOKENS = 24
TIMEOUT_S = 30  # the servers' --request-timeout-s: every stream ends by then


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProc, ServerProc]]:
    tmp = tmp_path_factory.mktemp("double")
    args = ["--request-timeout-s", str(TIMEOUT_S)]
    ref = ServerProc(["--kv-root", str(tmp / "ref"), *args])
    try:
        faulty = ServerProc(["--kv-root", str(tmp / "kv"), *args], log=tmp / "faulty.log")
    except BaseException:
        ref.stop()
        raise
    try:
        yield ref, faulty
    finally:
        ref.stop()
        faulty.stop()


async def _session(
    client: object, i: int, tag: str, trigger: tuple[int, int], fire: asyncio.Event
) -> list[str]:
    """Two turns of one conversation; ``fire`` is set when turn ``trigger[0]`` has streamed
    ``trigger[1]`` chunks. The texts, or ``ERR …`` for a turn that ended with an error."""
    messages = [{"role": "user", "content": f"{tag}: session {i} asks about item {i * 7}"}]
    texts: list[str] = []
    for turn in range(2):
        chunks: list[str] = []
        try:
            stream = await client.chat.completions.create(  # type: ignore[attr-defined]
                model="dualpath-tiny",
                messages=messages,
                max_tokens=TOKENS,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks.append(chunk.choices[0].delta.content)
                    if (turn, len(chunks)) == trigger:
                        fire.set()
        except openai.APIError as exc:
            texts.append(f"ERR {type(exc).__name__}")
            return texts
        texts.append("".join(chunks))
        messages += [
            {"role": "assistant", "content": texts[-1]},
            {"role": "user", "content": f"and then {turn}?"},
        ]
    return texts


def _run(
    server: ServerProc, tag: str, trigger: tuple[int, int], kill: list[str]
) -> list[list[str]]:
    async def main() -> list[list[str]]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT_S + 30
        )
        fire = asyncio.Event()

        async def killer() -> None:
            await fire.wait()
            pids = [p for name in kill for p in named(server.proc.pid, name)]
            assert len(pids) == len(kill), (kill, pids)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)

        sessions = [_session(client, i, tag, trigger, fire) for i in range(SESSIONS)]
        waiter = asyncio.ensure_future(killer()) if kill else None
        out = await asyncio.wait_for(asyncio.gather(*sessions), TIMEOUT_S + 20)
        if waiter is not None:
            await waiter
        await client.close()
        return list(out)

    return asyncio.run(main())


STORAGE = ["storage@node0", "storage@node1"]


@pytest.mark.parametrize(
    ("trigger", "kill"),
    [
        ((0, 1), STORAGE),  # as the first tokens stream: prompt blocks being written
        ((0, TOKENS - 1), STORAGE),  # at the end of the first turn
        ((1, 1), STORAGE),  # in the second turn: its reads
        ((0, 4), [*STORAGE, "de2@node1"]),
        ((1, 2), ["pe0@node0", "storage@node1"]),
    ],
    ids=["storage-early", "storage-late", "storage-turn2", "storage+de", "pe+storage"],
)
def test_processes_killed_at_once_mid_stream(
    servers: tuple[ServerProc, ServerProc], trigger: tuple[int, int], kill: list[str]
) -> None:
    ref, faulty = servers
    tag = "-".join(map(str, trigger)) + "-" + "+".join(kill)
    want = _run(ref, tag, trigger, [])
    got = _run(faulty, tag, trigger, kill)
    for w, g in zip(want, got, strict=True):
        assert len(w) == 2 and (len(g) == 2 or g[-1].startswith("ERR")), (w, g)
        for turn, text in enumerate(g):
            if text.startswith("ERR"):  # a clean error ends the session
                assert turn == len(g) - 1
            else:
                assert text == w[turn], (w, g)  # exactly the fault-free text
    clean = sum(1 for g in got if not any(t.startswith("ERR") for t in g))
    assert clean >= 1, got  # the runtime recovered: not every session failed
    out = Path(str(faulty.log)).read_text(errors="replace") if faulty.log else ""
    assert "Traceback" not in out, out[-3000:]
