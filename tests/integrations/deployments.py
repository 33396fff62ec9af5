"""Helpers of the end-to-end vLLM tests: a plain vLLM instance (the reference every answer is
compared with) and a ``dualpath serve --engine vllm`` deployment, each a real process group on
127.0.0.1, stopped with SIGTERM (SIGKILL of the group after a grace period)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from dualpath.integrations.vllm.processes import group_segments, unlink_unmapped
from dualpath.net import free_port

REPO = Path(__file__).resolve().parents[2]


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int:
    """SIGTERM (SIGKILL of its group after ``timeout_s``); the shared memory its group mapped
    and left behind unlinked (a TP / PP vLLM CPU instance leaves its ranks' segments)."""
    segments = group_segments(proc.pid) if proc.poll() is None else set()
    try:
        return _stop(proc, timeout_s)
    finally:
        unlink_unmapped(segments)


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return int(proc.returncode)


class Plain:
    """One plain vLLM OpenAI server (no connector) on ``checkpoint`` with vLLM flags ``args``;
    started at once, ``ready()`` waits for it (so that a deployment can start meanwhile).
    ``bind``: its ranks' cores (``VLLM_CPU_OMP_THREADS_BIND``, one list per rank)."""

    def __init__(
        self, python: str, checkpoint: Path, model: str, log: Path, args: list[str], bind: str
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        if bind:  # (else vLLM's own)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(checkpoint),
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="x", timeout=120, max_retries=0
        )

    def ready(self, timeout_s: float = 400) -> Plain:
        wait_health(self.url, self.proc, self.log, timeout_s)
        return self

    def stop(self) -> int:
        return stop(self.proc)


class Deployment:
    """``dualpath serve --engine vllm`` on ``checkpoint`` with serve flags ``args``, started at
    once; ``ready()`` waits until the router serves ``/health``."""

    def __init__(
        self, checkpoint: Path, kv_root: Path, logs: Path, args: list[str], env: dict[str, str]
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = logs
        self.kv_root = kv_root
        logs.mkdir(parents=True, exist_ok=True)
        self.out = logs / "serve.log"
        cmd = [
            sys.executable,
            "-m",
            "dualpath.cli.main",
            "serve",
            "--engine",
            "vllm",
            "--model-dir",
            str(checkpoint),
            "--port",
            str(self.port),
            "--kv-root",
            str(kv_root),
            "--vllm-log-dir",
            str(logs),
            "--set",
            "scheduler.record_decisions=true",
            *args,
        ]
        with self.out.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
                env={**os.environ, **env},
            )
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="x", timeout=120, max_retries=0
        )

    def ready(self, timeout_s: float = 400) -> Deployment:
        try:
            wait_health(self.url, self.proc, self.out, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def metric(self, name: str, label: str = "") -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name) and label in line and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def read_side(self, side: str) -> None:
        r = httpx.put(self.url + "/v1/dualpath/read_side", json={"read_side": side})
        assert r.status_code == 200, r.text

    def instance_log(self, node: int) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs.glob(f"vllm{node}-*.log"))

    def pids(self) -> dict[str, dict[str, int]]:
        data: dict[str, dict[str, int]] = json.loads((self.logs / "processes.json").read_text())
        return data

    def stop(self) -> int:
        return stop(self.proc)


def agent_turns(client: Any, model: str, prompt: str, max_tokens: int = 12) -> list[Any]:
    """Two turns of one agent, greedy: the second repeats the first and its answer; each
    answer's (text, prompt tokens, cached tokens)."""
    kw: dict[str, Any] = {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True},
    }
    out = []
    for _ in range(2):
        r = client.completions.create(prompt=prompt, **kw)
        details = r.usage.prompt_tokens_details
        out.append((r.choices[0].text, r.usage.prompt_tokens, details and details.cached_tokens))
        prompt = prompt + r.choices[0].text + " Next."
    return out


def _output_text(answer: dict[str, Any]) -> str:
    """The text of a Responses API answer (its message items' output_text parts)."""
    return "".join(
        part.get("text", "")
        for item in answer.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
    )


def route_answers(url: str, model: str) -> dict[str, Any]:
    """What vLLM's routes and fields answer at ``url``: each probe's status and the facts two
    servers of one checkpoint share (greedy texts, token ids, ids named by ``x-request-id``,
    error types), for a plain vLLM instance and the router alike."""
    client = httpx.Client(base_url=url, timeout=120)
    out: dict[str, Any] = {}
    r = client.post("/tokenize", json={"model": model, "prompt": "Hello agent world"})
    tokens = r.json().get("tokens")
    out["tokenize"] = (r.status_code, tokens)
    r = client.post("/detokenize", json={"model": model, "tokens": tokens})
    out["detokenize"] = (r.status_code, r.json().get("prompt"))
    r = client.get("/version")
    out["version"] = (r.status_code, r.json().get("version"))
    r = client.get("/v1/models")
    card = r.json()["data"][0]
    out["models"] = (r.status_code, card["id"], card.get("max_model_len"))
    greedy = {"model": model, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    prompt = "The agent read the file and ran the tests. " * 3
    sampled = {**greedy, "temperature": 1.0, "seed": 7, "n": 2}  # (vLLM: n > 1 samples)
    r = client.post("/v1/completions", json={**sampled, "prompt": prompt})
    out["n=2"] = (r.status_code, [c["text"] for c in r.json().get("choices", [])])
    batch = [prompt + "First.", prompt + "Second, longer."]
    r = client.post("/v1/completions", json={**greedy, "prompt": batch})
    got = r.json()
    usage = got.get("usage") or {}
    out["batch"] = (
        r.status_code,
        [(c["index"], c["text"]) for c in got.get("choices", [])],
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )
    r = client.post(
        "/v1/completions", json={**greedy, "prompt": prompt}, headers={"X-Request-Id": "probe-7"}
    )
    out["x-request-id"] = (r.status_code, r.json().get("id"))
    r = client.post(
        "/v1/responses",
        json={"model": model, "input": prompt, "max_output_tokens": 8, "temperature": 0},
    )
    out["responses"] = (r.status_code, r.json().get("object"), _output_text(r.json()))
    for name, bad in (("max_tokens=-1", {"max_tokens": -1}), ("n=0", {"n": 0})):
        r = client.post("/v1/completions", json={**greedy, "prompt": prompt, **bad})
        err = r.json().get("error") or {}
        out[name] = (r.status_code, err.get("type"), err.get("code"))
    client.close()
    return out
