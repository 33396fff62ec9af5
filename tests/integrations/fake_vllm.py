"""Test helpers for the vLLM router without vLLM: a deployment's real side-cars, buffers and
store, and in-process fake vLLM instances (``FakeInstances``: an ``httpx.MockTransport``
answering ``/tokenize`` and the OpenAI routes as vLLM does, persisting the prompt's blocks as
the connector would), the router served by uvicorn on a free port in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dualpath.config import config_for, preset
from dualpath.config.systems import system_spec
from dualpath.integrations.vllm.app import create_app
from dualpath.integrations.vllm.flow import TurnFlow
from dualpath.integrations.vllm.launch import _wait_healthy
from dualpath.integrations.vllm.node import wait_ready
from dualpath.integrations.vllm.params import TransferParams
from dualpath.integrations.vllm.processes import Launched, unlink_unmapped
from dualpath.integrations.vllm.router import Router, RouterOptions
from dualpath.integrations.vllm.setup import Deployment, Instance, VllmOptions, plan
from dualpath.kv.store import KVStore, block_keys
from dualpath.net import free_port
from dualpath.policy import make_policy

MODEL_CONFIG = {
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "hidden_size": 64,
}


def fake_tokens(text: str) -> list[int]:
    """The fake tokenizer: one token per character."""
    return [ord(c) % 1000 for c in text]


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"<{m['role']}>{m.get('content') or ''}" for m in body["messages"])
    return str(body.get("prompt", ""))


FAKE_INSTANCE = """
import http.server, subprocess, sys
from multiprocessing.shared_memory import SharedMemory
# as vLLM's EngineCore: a child in the instance's process group, and a message queue
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
queue = SharedMemory(create=True, size=4096)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def fake_instance(inst: Instance) -> list[str]:
    """A stand-in vLLM instance process: ``/health`` on its port, a child process, a
    ``/dev/shm/psm_*`` segment."""
    return [sys.executable, "-c", FAKE_INSTANCE, inst.url.rsplit(":", 1)[1]]


def _segments() -> set[str]:
    return {p.name for pattern in ("psm_*", "sem.mp-*") for p in Path("/dev/shm").glob(pattern)}


@contextlib.contextmanager
def sidecars(
    tmp_path: Path,
    buffer_mib: int = 1,
    max_model_len: int = 512,
    instances: Callable[[Instance], list[str]] | None = None,
    snic_bytes_per_s: float = 0.0,
) -> Iterator[Launched]:
    """The side-cars (real processes: buffers, store) of a 1P1D deployment of a fake model;
    its instances too with ``instances`` (their command; waited for until ``/health``);
    ``snic_bytes_per_s``: each SNIC's emulated rate (0: unpaced)."""
    ckpt = tmp_path / "model"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(MODEL_CONFIG))
    opts = VllmOptions(
        str(ckpt),
        buffer_mib=buffer_mib,
        max_model_len=max_model_len,
        kv_root=str(tmp_path / "kv"),
        snic_bytes_per_s=snic_bytes_per_s,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="dpt-"))  # short: Unix socket paths
    dep = plan(opts, "w" * 32, run_dir, "fake-engine")
    (run_dir / "logs").mkdir()
    cmds = [
        [sys.executable, "-m", "dualpath.integrations.vllm.sidecar", s.to_json()] for s in dep.nodes
    ]
    inst_cmds = [instances(i) for i in dep.instances] if instances else []
    out = Launched(
        dep, run_dir, run_dir / "logs", cmds, inst_cmds, [dict(os.environ)] * len(inst_cmds)
    )
    before = _segments()
    try:
        for i in range(len(dep.nodes)):
            out.start_sidecar(i)
        for spec in dep.nodes:
            wait_ready(spec.socket_path)
        for i in range(len(inst_cmds)):
            out.start_instance(i)
        if inst_cmds:
            _wait_healthy(out, 30.0)
        yield out
    finally:
        out.stop(grace_s=5.0)
        unlink_unmapped(_segments() - before)  # the stand-ins', which SIGTERM does not unlink
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class FakeInstances:
    """vLLM instances as the router sees them: ``/tokenize``, and the chat / text routes; the
    decode persists the prompt's new full blocks into the store (the namespace the router
    gave it), reports ``cached_tokens`` as vLLM would (prompt − 1: the buffer load), streams
    ``num_tokens`` events. ``stall_s``: the decode waits this long before (``stall_at`` 0) or
    after its first event (1)."""

    dep: Deployment
    kv_root: str
    num_tokens: int = 4
    stall_s: float = 0.0
    stall_at: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)  # the bodies the decode got
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (url, headers)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        self.requests.append((str(request.url), dict(request.headers)))
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": fake_tokens(_prompt_text(body))})
        if path == "/detokenize":
            return httpx.Response(200, json={"prompt": "".join(chr(t) for t in body["tokens"])})
        if path == "/version":
            return httpx.Response(200, json={"version": "fake"})
        if path == "/v1/models":
            model = {"id": self.dep.model, "object": "model", "max_model_len": 512}
            return httpx.Response(200, json={"object": "list", "data": [model]})
        if path.startswith("/v1/responses"):
            return httpx.Response(200, json={"id": "resp_1", "object": "response"})
        params = TransferParams.from_request(body.get("kv_transfer_params"))
        assert params is not None, "a request without DualPath params"
        if params.save is not None:  # the prefill: max_tokens 1
            return httpx.Response(200, json={"id": "p", "choices": [{"index": 0, "text": "x"}]})
        self.seen.append(body)
        self._persist(body, params)
        tokens = fake_tokens(_prompt_text(body))
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": self.num_tokens,
            "total_tokens": len(tokens) + self.num_tokens,
            "prompt_tokens_details": {"cached_tokens": len(tokens) - 1},
        }
        chat = "messages" in body
        if not body.get("stream"):
            if self.stall_s:
                await asyncio.sleep(self.stall_s)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": "ab"}}
                if chat
                else {"index": 0, "text": "ab"}
            )
            return httpx.Response(200, json={"id": "d", "choices": [choice], "usage": usage})
        usage_too = bool((body.get("stream_options") or {}).get("include_usage"))
        return httpx.Response(
            200,
            content=self._events(chat, usage if usage_too else None),
            headers={"content-type": "text/event-stream"},
        )

    async def _events(self, chat: bool, usage: dict[str, Any] | None) -> AsyncIterator[bytes]:
        rid = f"cmpl-{len(self.seen)}"  # one id per stream, as vLLM's

        def event(payload: dict[str, Any]) -> bytes:
            text = json.dumps({"id": rid, **payload}, separators=(",", ":"))
            return b"data: " + text.encode() + b"\n\n"

        if self.stall_s and self.stall_at == 0:
            await asyncio.sleep(self.stall_s)
        if chat:
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(self.num_tokens):
            if self.stall_s and self.stall_at == 1 and i == 1:
                await asyncio.sleep(self.stall_s)
            piece = {"delta": {"content": "t"}} if chat else {"text": "t"}
            whole = event({"choices": [{"index": 0, **piece}], "usage": None})
            yield whole[:7]  # events cut anywhere on the wire
            yield whole[7:]
        if usage is not None:
            yield event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _persist(self, body: dict[str, Any], params: TransferParams) -> None:
        assert params.persist is not None and params.load is not None
        tokens = fake_tokens(_prompt_text(body))
        bs = self.dep.block_tokens
        keys = block_keys(tokens, bs, params.persist.namespace)
        store = KVStore(self.kv_root, self.dep.nodes[0].layout, namespace=self.dep.namespace(""))
        payload = bytes(self.dep.nodes[0].layout.full_block_bytes)
        for key in keys[params.persist.first_block : len(tokens) // bs]:
            store.write_block(key, payload)


class RouterServer:
    """The router app (real ``TurnFlow`` over ``launched``'s side-cars, ``FakeInstances``)
    served by uvicorn on 127.0.0.1 in a thread; ``call`` runs a coroutine in its loop."""

    def __init__(
        self,
        launched: Launched,
        options: RouterOptions,
        fakes: FakeInstances,
        background: list[Any] | None = None,
        restarts: Mapping[str, int] | None = None,
    ) -> None:
        import uvicorn

        config = config_for(preset("tiny-1p1d"), system_spec("dualpath"))
        kv_root = launched.deployment.nodes[0].kv_root
        self.flow = TurnFlow(launched.deployment, make_policy(config), kv_root)
        self.router = Router(self.flow, options, transport=fakes.transport())
        self.loop: asyncio.AbstractEventLoop | None = None
        ready = threading.Event()

        async def capture() -> None:
            self.loop = asyncio.get_running_loop()
            ready.set()
            await asyncio.Event().wait()

        app = create_app(self.router, [capture, *(background or [])], restarts)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert ready.wait(30), "the router did not start"
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.spawn(coro).result(timeout=30)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` in the router's loop (a task); its future."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def metric(self, name: str, label: str = "", headers: dict[str, str] | None = None) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and label in line
        )

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.flow.close()
