"""vLLM's own disaggregated prefill/decode (NixlConnector, KV over NIXL/UCX) as a reference:
a prefill and a decode vLLM instance and a small proxy, on one host or on two cluster nodes.

Run: .venv/bin/python benchmarks/stock_pd.py [--model-dir DIR] [--cluster NAME]

Starts one plain vLLM, then (after stopping it) the stock PD pair with its proxy, sends both the
same greedy requests (answers must be equal), and prints TTFT / TPOT p50 at concurrency 1 for
both and the KV bytes NIXL moved (the decode's ``vllm:nixl_bytes_transferred``). NIXL is
installed into an overlay folder (``ensure_overlay``) that only the instances import: vLLM's
own venv stays as ``make vllm`` made it. This file never imports vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from dualpath.integrations.vllm.launch import find_vllm_python, in_namespace
from dualpath.integrations.vllm.setup import core_masks
from dualpath.net import free_port

FLAGS = ["--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "4096"]  # bench_vllm's
KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
# UCX over TCP only: no InfiniBand / RDMA-CM / CMA on this host (or inside a namespace)
UCX_ENV = {"UCX_MODULES": "^ib,rdmacm,cma", "UCX_TLS": "tcp"}
# what the prefill gets: produce the KV, keep it for the decode to pull
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
DEFAULT_OVERLAY = Path(__file__).resolve().parents[1] / "runs" / "nixl-overlay"
NS_PORTS = {"prefill": (8100, 5600), "decode": (8200, 5601)}  # (HTTP, side channel) in a netns


def ensure_overlay(target: str | Path = DEFAULT_OVERLAY) -> Path:
    """``nixl`` and ``nixl-cu12`` (no dependencies) installed by vLLM's pip into ``target``
    unless they are there already; ``target``. RuntimeError with pip's last line if it fails."""
    root = Path(target).resolve()
    if any(root.glob("nixl-*.dist-info")) and any(root.glob("nixl_cu12-*.dist-info")):
        return root
    pip = [
        find_vllm_python(),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        str(root),
        "nixl",
        "nixl-cu12",
    ]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"pip install nixl nixl-cu12 into {root} failed: {lines[-1]}")
    return root


def _start(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:  # a group of its own: EngineCore and workers die with it
        return subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; children of its group may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    proc.poll()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until ``url``/health answers 200; RuntimeError with the log's tail if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout_s} s (log: {log})")


class StockPD:
    """A prefill and a decode vLLM instance with NixlConnector and our proxy (``.url``).

    ``prefill`` / ``decode`` are ``(namespace, host)``: the instance runs under ``ip netns exec
    namespace`` (``""``: this namespace) and listens on ``host``, which the proxy in the root
    namespace must reach. ``port``: the proxy's, on 127.0.0.1 (0: a free one). The instances'
    OpenMP threads get the cores split as our own deployment splits them (``core_masks``).
    Started by ``start()`` / ``with``; ``stop()`` kills every process group it started.
    """

    def __init__(
        self,
        model_dir: str | Path,
        prefill: tuple[str, str] = ("", "127.0.0.1"),
        decode: tuple[str, str] = ("", "127.0.0.1"),
        port: int = 0,
        log_dir: str | Path | None = None,
        vllm_args: list[str] | None = None,
        overlay: str | Path = DEFAULT_OVERLAY,
        startup_timeout_s: float = 400.0,
    ) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.seats = {"prefill": prefill, "decode": decode}
        self.port = port
        self.log_dir = Path(log_dir) if log_dir else None
        self.vllm_args = list(FLAGS if vllm_args is None else vllm_args)
        self.overlay = Path(overlay)
        self.startup_timeout_s = startup_timeout_s
        self.urls: dict[str, str] = {}
        self.url = ""
        self._procs: list[subprocess.Popen[bytes]] = []

    def _ports(self, role: str) -> tuple[int, int]:
        namespace, host = self.seats[role]
        if namespace:  # a node of its own: fixed ports (this namespace cannot probe its ports)
            return NS_PORTS[role]
        return free_port(host), free_port(host)

    def _instance(self, role: str, python: str, overlay: Path, mask: str, log: Path) -> None:
        namespace, host = self.seats[role]
        http_port, side_port = self._ports(role)
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_dir.name,
            "--host",
            host,
            "--port",
            str(http_port),
            *self.vllm_args,
            "--kv-transfer-config",
            KV_CONFIG,
        ]
        env = {
            **os.environ,
            **UCX_ENV,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": mask,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(overlay), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        self._procs.append(_start(in_namespace(namespace, argv), log, env))
        self.urls[role] = f"http://{host}:{http_port}"

    def start(self) -> StockPD:
        overlay = ensure_overlay(self.overlay)
        python = find_vllm_python()
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="stock-pd-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        masks = core_masks([1, 1], os.cpu_count() or 1)
        try:
            for role, mask in zip(("prefill", "decode"), masks, strict=True):
                self._instance(role, python, overlay, mask, log_dir / f"{role}.log")
            for role, proc in zip(("prefill", "decode"), self._procs, strict=True):
                wait_healthy(self.urls[role], proc, log_dir / f"{role}.log", self.startup_timeout_s)
            port = self.port or free_port()
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "proxy",
                "--prefill",
                self.urls["prefill"],
                "--decode",
                self.urls["decode"],
                "--port",
                str(port),
            ]
            self._procs.append(_start(argv, log_dir / "proxy.log"))
            self.url = f"http://127.0.0.1:{port}"
            wait_healthy(self.url, self._procs[-1], log_dir / "proxy.log", 60.0)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in reversed(self._procs):
            stop_group(proc)
        self._procs.clear()

    def __enter__(self) -> StockPD:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the proxy: prefill with max_tokens 1 and do_remote_decode, then the decode pulls the KV ---


def proxy_app(prefill_url: str, decode_url: str) -> Any:
    """The OpenAI routes over one prefill and one decode instance (SSE passed through)."""
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))

    def passthrough(r: httpx.Response) -> Response:
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def generate(request: Request, path: str) -> Response:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        first = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        first.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
        if path.endswith("chat/completions"):
            first["max_completion_tokens"] = 1
        try:
            pre = await client.post(prefill_url + path, json=first, headers=headers)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"prefill instance: {exc!r}"}, 503)
        if pre.status_code != 200:
            return passthrough(pre)
        params = pre.json().get("kv_transfer_params")
        if not params:
            return JSONResponse({"error": "the prefill answered without kv_transfer_params"}, 502)
        second = {**body, "kv_transfer_params": params}
        try:
            if not body.get("stream"):
                return passthrough(
                    await client.post(decode_url + path, json=second, headers=headers)
                )
            req = client.build_request("POST", decode_url + path, json=second, headers=headers)
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": f"decode instance: {exc!r}"}, 503)
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            return passthrough(resp)
        return StreamingResponse(
            resp.aiter_raw(), media_type="text/event-stream", background=BackgroundTask(resp.aclose)
        )

    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    async def health(request: Request) -> Response:
        try:
            codes = [
                (await client.get(u + "/health")).status_code for u in (prefill_url, decode_url)
            ]
        except httpx.HTTPError as exc:
            return JSONResponse({"error": repr(exc)}, 503)
        return Response(status_code=200 if codes == [200, 200] else 503)

    async def models(request: Request) -> Response:
        return passthrough(await client.get(decode_url + "/v1/models"))

    async def tokenize(request: Request) -> Response:
        return passthrough(
            await client.post(
                decode_url + "/tokenize",
                content=await request.body(),
                headers={"content-type": "application/json"},
            )
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
        ]
    )


def proxy_main(argv: list[str]) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="stock_pd.py proxy")
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    app = proxy_app(args.prefill, args.decode)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


# --- the run: plain vLLM vs stock PD ---

PROMPTS = ["Tell me about the sea.", "List three colours and a number.", "Why is the sky blue?"]


def _answers(url: str, model: str) -> list[str]:
    """Greedy answers: each prompt by chat (not streamed), the first streamed, one completion."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for p in PROMPTS:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": p}],
                "max_tokens": 16,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(r.json()["choices"][0]["message"]["content"])
        body["messages"] = [{"role": "user", "content": PROMPTS[0]}]
        parts = []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        parts.append(ch["delta"].get("content") or "")
        out.append("".join(parts))
        r = c.post(
            "/v1/completions",
            json={"model": model, "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.0},
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def _latency(url: str, model: str, agents: int) -> dict[str, Any]:
    from dualpath.frontend.loadgen import LoadGenerator, LoadgenOptions
    from dualpath.workload.scripts import chat_scripts

    warm = chat_scripts(1, 2, 0.05, 8, 32, seed=99)
    asyncio.run(LoadGenerator(LoadgenOptions(url, model=model, concurrency=1)).run(warm))
    solo = chat_scripts(agents, 3, 0.05, 16, 32, seed=1)
    res = asyncio.run(LoadGenerator(LoadgenOptions(url, model=model, concurrency=1)).run(solo))
    return res.summary()


def nixl_bytes(decode_url: str) -> tuple[float, float]:
    """(bytes, transfers) NIXL moved into the decode: ``vllm:nixl_bytes_transferred``."""
    total, count = 0.0, 0.0
    for line in httpx.get(decode_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:nixl_bytes_transferred_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:nixl_bytes_transferred_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def _plain(ckpt: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [
        find_vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ckpt),
        "--served-model-name",
        ckpt.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *FLAGS,
    ]
    proc = _start(argv, log, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, 400)
    except BaseException:
        stop_group(proc)
        raise
    return proc, url


def _line(name: str, s: dict[str, Any]) -> str:
    return (
        f"{name:<9} TTFT p50 {s['ttft_s']['p50'] * 1e3:7.1f} ms  TPOT p50 "
        f"{s['tpot_s']['p50'] * 1e3:6.1f} ms  requests {s['requests']}  errors {s['errors']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="a checkpoint vLLM loads (default: a tiny random Llama)")
    ap.add_argument("--cluster", help="prefill on the cluster's p0, decode on d0")
    ap.add_argument("--agents", type=int, default=3, help="agents × 3 turns at concurrency 1")
    ap.add_argument("--overlay", default=str(DEFAULT_OVERLAY))
    ap.add_argument("--log-dir")
    args = ap.parse_args()
    prefill = decode = ("", "127.0.0.1")
    if args.cluster:
        from dualpath.deploy.cluster import ClusterState

        spec = ClusterState.load(args.cluster).spec
        p0, d0 = spec.node("p0"), spec.node("d0")
        prefill, decode = (p0.namespace, p0.cnic_addr), (d0.namespace, d0.cnic_addr)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            ckpt = Path(args.model_dir).resolve()
        else:
            from dualpath.frontend.checkpoint import write_tiny_checkpoint

            ckpt = write_tiny_checkpoint(
                Path(tmp) / "llama-4l-256",
                num_layers=4,
                hidden_size=256,
                num_heads=4,
                num_kv_heads=2,
                intermediate_size=688,
            )
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        proc, url = _plain(ckpt, log_dir / "plain.log")
        try:  # one vLLM deployment at a time
            want, plain = _answers(url, ckpt.name), _latency(url, ckpt.name, args.agents)
        finally:
            stop_group(proc)
        print(_line("vllm", plain), flush=True)
        with StockPD(ckpt, prefill, decode, log_dir=log_dir, overlay=args.overlay) as pd:
            got, stock = _answers(pd.url, ckpt.name), _latency(pd.url, ckpt.name, args.agents)
            moved, transfers = nixl_bytes(pd.urls["decode"])
        print(_line("stock-pd", stock), flush=True)
        print(
            f"          NIXL into the decode: {moved / 1e6:.2f} MB in {transfers:.0f} transfers "
            f"(vllm:nixl_bytes_transferred)"
        )
        same = sum(a == b for a, b in zip(want, got, strict=True))
        print(
            f"answers equal to plain vLLM: {same}/{len(want)} (greedy; chat, streamed chat, "
            f"completion)"
        )
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                print(f"  #{i}: vllm {a!r} / stock-pd {b!r}")
        print(
            f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
            f"prefill {prefill[1] or '-'} {prefill[0] or '(root ns)'}, decode {decode[1]} "
            f"{decode[0] or '(root ns)'}"
        )
        if same != len(want):
            raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["proxy"]:
        proxy_main(sys.argv[2:])
    else:
        main()
