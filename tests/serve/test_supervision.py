"""Supervision (issue 24, item 3): the death of the runtime's scheduler process is detected at
once and the server fails fast — in-flight requests end with a clean OpenAI-shaped error,
``/health`` is 503, the server exits non-zero (a process manager restarts it; the KV store
persists), and no process, shared-memory segment or links directory outlives the runtime."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.procs import descendants, shm_used_by  # noqa: E402
from tests.serve.conftest import ServerProc  # noqa: E402
from tests.serve.stub import StubBackend  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _scheduler_pid(server_pid: int) -> int:
    """The server's child that has children of its own (the resource tracker has none)."""
    kids = [p for p in descendants(server_pid) if _parent(p) == server_pid]
    return next(p for p in kids if descendants(p))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_killing_the_scheduler_process_fails_fast_and_leaves_nothing(tmp_path: Path) -> None:
    server = ServerProc(["--preset", "tiny-1p1d", "--kv-root", str(tmp_path / "kv")])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)  # fmt: skip
        stream = client.completions.create(model="dualpath-tiny", prompt="x", max_tokens=4000,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
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
    from dualpath.serve.api import ApiOptions, create_app

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
