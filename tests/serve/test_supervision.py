"""Supervision: a killed fork server, storage worker, PE or DE is replaced while the server
serves on (every answer equal to the fault-free one; ``/health`` not ready while a process
is being restarted); the death of the runtime's scheduler process is detected at once and
the server fails fast — in-flight requests end with a clean OpenAI-shaped error, ``/health``
is 503, the server exits non-zero (a process manager restarts it; the KV store persists),
and no process, shared-memory segment or links directory outlives the runtime."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.frontend.stub import StubBackend  # noqa: E402
from tests.procs import descendants, shm_used_by  # noqa: E402
from tests.serve.conftest import ServerProc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _scheduler_pid(server_pid: int) -> int:
    """The server's child that has children of its own (the resource tracker has none)."""
    kids = [p for p in descendants(server_pid) if _parent(p) == server_pid]
    return next(p for p in kids if descendants(p))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _supervise() -> Any:
    """``benchmarks/supervise_serve.py`` (the kills and the checks of its acceptance runs)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "supervise_serve.py"
    spec = importlib.util.spec_from_file_location("supervise_serve", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_every_kind_of_kill_keeps_serving_then_the_scheduler_fails_fast(tmp_path: Path) -> None:
    """One server (the SNIC slowed: a cached prompt's read takes ~1.7 s). SIGKILL, each in
    turn: the fork server idle, the fork server during streams, a storage worker inside a
    read, a PE and a DE during streams. Every answer equals its fault-free one (the same
    prompts answered before any kill), ``/health`` goes not-ready then ready again, the
    server serves on. Last, its scheduler process: in-flight requests end with a clean
    error, ``/health`` is 503 at once, the server exits non-zero (a process manager restarts
    it; the KV store persists), and no process, shared-memory segment or links directory
    outlives the runtime."""
    sv = _supervise()
    args = sv.parse_args(
        [
            "kinds",
            "--streams",
            "2",
            "--max-tokens",
            "12",
            "--prompt-words",
            "250",
            "--snic-mb-per-s",
            "2",
            "--not-ready-wait-s",
            "0.3",
        ]
    )
    rounds = sv.texts_for(args)
    server = ServerProc(
        ["--preset", "tiny-1p1d", "--kv-root", str(tmp_path / "kv"), *sv.server_args(args)]
    )
    try:
        want = asyncio.run(sv.answers(server.url, rounds, args))
        kills = asyncio.run(sv.kill_rounds(server, rounds, want, args, persisted=True))
        assert [k.case for k in kills] == [
            "forkserver-idle",
            "forkserver-streams",
            "pe",
            "de",
            "storage-read",
        ]
        for k in kills:
            assert k.errors == [] and k.equal == k.answers > 0, k
            assert k.serving, k
        by_case = {k.case: k for k in kills}
        for case in ("pe", "de", "storage-read"):  # recovering: not ready until it acked
            assert by_case[case].saw_not_ready, by_case[case]
        assert by_case["storage-read"].read_in_flight  # the read was re-issued, not lost

        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        )
        stream = client.completions.create(
            model="dualpath-tiny",
            prompt="x",
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # the request is running in the engines
        sched = _scheduler_pid(server.proc.pid)
        procs = descendants(server.proc.pid)
        shm = shm_used_by(procs)
        links = list(Path(tempfile.gettempdir()).glob(f"dp{sched}-*-links-*"))
        assert shm and links  # the node buffers and the pacers' links directory
        os.kill(sched, signal.SIGKILL)
        with pytest.raises(openai.APIError) as err:  # an error event, not a cut answer
            for _ in stream:
                pass
        assert "the runtime failed" in str(err.value)
        assert server.proc.wait(timeout=60) == 1  # fail-fast: non-zero for a process manager
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in procs):
            time.sleep(0.1)
        assert [p for p in procs if Path(f"/proc/{p}").exists()] == []
        assert [f for f in shm if Path(f).exists()] == []
        assert [d for d in links if d.exists()] == []
        out = server.proc.stdout.read().decode() if server.proc.stdout else ""
        assert "runtime stopped: the scheduler process exited" in out
        assert "Traceback" not in out
    finally:
        server.stop()


def test_a_failed_runtime_is_503_on_health_and_on_requests() -> None:
    from dualpath.frontend.api import ApiOptions, create_app

    app = create_app(StubBackend(failure="the scheduler process exited (code -9)"), ApiOptions())  # type: ignore[arg-type]

    async def ask() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"model": "stub", "prompt": "hello", "max_tokens": 2}
            return await c.get("/health"), await c.post("/v1/completions", json=body)

    health, completion = asyncio.run(ask())
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert completion.status_code == 503
    assert completion.json()["error"]["type"] == "server_error"
    assert "the runtime failed" in completion.json()["error"]["message"]


def test_a_recovering_runtime_is_503_on_health_and_still_serves() -> None:
    from dualpath.frontend.api import ApiOptions, create_app

    why = "pe0@node0: died, respawning"
    app = create_app(StubBackend(not_ready=why), ApiOptions())  # type: ignore[arg-type]

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/health")

    health = asyncio.run(ask())
    assert health.status_code == 503
    assert health.json() == {"status": "recovering", "reason": why}


def test_a_failing_run_is_503_at_once_not_once_its_processes_are_stopped() -> None:
    """The run raised: ``FailedEvt`` comes before the seconds its processes take to stop
    (``ClosedEvt``); the backend fails its streams and ``/health`` on the first one."""
    import queue
    import threading

    from dualpath.config import preset
    from dualpath.frontend.tokenizer import TinyTokenizer
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.serve.runtime_backend import RuntimeBackend, _Stream
    from dualpath.serve.runtime_host import ClosedEvt, FailedEvt, HealthEvt

    class Alive:
        def is_alive(self) -> bool:
            return True

    backend = RuntimeBackend(preset("tiny-1p1d"), RuntimeOptions(), TinyTokenizer(), "tiny")
    outbox: queue.Queue[object] = queue.Queue()
    backend._outbox, backend._proc = outbox, Alive()
    failures: list[str] = []
    backend.on_failure = failures.append
    loop = asyncio.new_event_loop()
    stream = _Stream(loop, asyncio.Queue())
    backend._streams[7] = stream
    reader = threading.Thread(target=backend._read_loop)
    reader.start()
    try:
        outbox.put(HealthEvt("de2@node1: died, respawning"))
        outbox.put(FailedEvt("RuntimeFailure: storage@node0: boom"))
        deadline = time.monotonic() + 5
        while backend.failure() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.failure() == "RuntimeFailure: storage@node0: boom"  # no ClosedEvt yet
        assert backend.not_ready() == "de2@node1: died, respawning"
        assert failures == ["RuntimeFailure: storage@node0: boom"]
        loop.run_until_complete(asyncio.sleep(0))  # the delivery scheduled on its loop
        assert stream.queue.get_nowait() == ClosedEvt("RuntimeFailure: storage@node0: boom")
    finally:
        outbox.put(ClosedEvt("RuntimeFailure: storage@node0: boom"))
        reader.join(timeout=5)
        loop.close()
    assert not reader.is_alive() and failures == ["RuntimeFailure: storage@node0: boom"]
