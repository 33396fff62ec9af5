"""Load generator for any OpenAI-compatible endpoint (ours, vLLM, SGLang).

Agent mode replays design §9 trajectories (scaled): each agent resends its whole conversation
every turn (append as a user message, the model's reply as an assistant message), streaming,
with ``max_tokens`` = the turn's forced generation. Trace mode replays a Mooncake trace: each
session's prompts extend one growing text, so repeated prefixes can hit. Appends are words
from a seeded ``random.Random`` (≈ one token per word on BPE tokenizers; the server's
``usage`` gives the exact counts, which are what we report). Measures TTFT, TTST (first to
second token), TPOT and ITL (``metrics.latency``), per-agent JCT and the job's makespan, and the
hit ratio from ``usage.prompt_tokens_details.cached_tokens``. The scripts come from
``workload.scripts`` (``chat_scripts``, ``trace_scripts``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dualpath.metrics import latency
from dualpath.metrics.percentiles import Percentiles
from dualpath.workload.scripts import ChatScript

_WORDS = [
    "the",
    "a",
    "of",
    "to",
    "in",
    "is",
    "it",
    "on",
    "for",
    "as",
    "at",
    "by",
    "be",
    "or",
    "an",
    "we",
    "if",
    "so",
    "do",
    "no",
    "up",
    "go",
    "my",
    "me",
    "us",
    "he",
    "ok",
    "run",
    "fix",
    "test",
    "file",
    "read",
    "code",
    "bug",
    "line",
    "call",
    "tool",
    "ls",
    "cat",
    "grep",
    "git",
    "make",
    "diff",
    "open",
    "edit",
]


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds from its start (its arrival). The
    second token is the second streamed chunk with text (one token per chunk on our server;
    another server may pack several). Latencies are ``metrics.latency``'s."""

    session_id: str
    turn: int
    ok: bool
    error: str = ""
    start_s: float = 0.0
    ttft_s: float | None = None  # first chunk with text
    second_token_s: float | None = None  # second chunk with text
    end_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    num_chunks: int = 0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with text

    @property
    def chunk_gaps_s(self) -> list[float]:
        """Gaps between consecutive chunks with text: ITL as vLLM's ``benchmark_serving``
        measures it (a server that streams in bursts has gaps near 0 between tokens that
        arrive together; the mean ``itl_s`` cannot show that)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def ttst_s(self) -> float | None:
        if self.ttft_s is None or self.second_token_s is None:
            return None
        return latency.ttst_s(self.ttft_s, self.second_token_s, self.completion_tokens)

    @property
    def tpot_s(self) -> float | None:
        if self.second_token_s is None:
            return None
        finish = self.end_s - self.start_s
        return latency.tpot_s(self.second_token_s, finish, self.completion_tokens)

    @property
    def itl_s(self) -> float | None:
        if self.ttft_s is None:
            return None
        return latency.itl_s(self.ttft_s, self.end_s - self.start_s, self.completion_tokens)


@dataclass(frozen=True, slots=True)
class LoadgenOptions:
    url: str
    model: str | None = None  # None: the first of /v1/models
    concurrency: int = 8
    api_key: str = "none"
    api: str = "chat"  # chat or completions
    ignore_eos: bool = True  # forced generation lengths (vLLM / SGLang / ours accept it)
    duration_s: float | None = None  # stop starting new turns after this long
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r} is invalid: must start with http:// or https://")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency {self.concurrency} is invalid: must be >= 1")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"--api {self.api!r} is invalid: must be chat or completions")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"--duration {self.duration_s} is invalid: must be > 0")


@dataclass(slots=True)
class LoadgenResult:
    requests: list[RequestResult] = field(default_factory=list)
    agent_jct_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)

        def pct(values: Sequence[float | None]) -> dict[str, float]:
            p = Percentiles.from_values([v for v in values if v is not None])
            return {k: v for k, v in asdict(p).items()}

        return {
            "requests": len(self.requests),
            "errors": len(self.requests) - len(ok),
            "first_errors": sorted({r.error for r in self.requests if not r.ok})[:5],
            "wall_s": self.wall_s,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "output_tokens_per_s": sum(r.completion_tokens for r in ok) / self.wall_s
            if self.wall_s
            else 0.0,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_ratio": cached / prompt if prompt else 0.0,
            "ttft_s": pct([r.ttft_s for r in ok]),
            "ttst_s": pct([r.ttst_s for r in ok]),
            "tpot_s": pct([r.tpot_s for r in ok]),
            "itl_s": pct([r.itl_s for r in ok]),
            "chunk_gap_s": pct([g for r in ok for g in r.chunk_gaps_s]),
            "agent_jct_s": pct(self.agent_jct_s),
            "job_jct_s": max(self.agent_jct_s, default=0.0),
        }


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


class LoadGenerator:
    """Runs scripts against ``options.url``; at most ``concurrency`` scripts at once."""

    def __init__(self, options: LoadgenOptions) -> None:
        self.options = options

    async def _model(self, client: Any) -> str:
        import httpx

        try:
            r = await client.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ValueError(f"--url {self.options.url}: cannot reach the server ({exc})") from None
        if r.status_code != 200:
            raise ValueError(f"--url {self.options.url}: GET /v1/models gave HTTP {r.status_code}")
        if self.options.model:
            return self.options.model
        return str(r.json()["data"][0]["id"])

    async def _request(
        self,
        client: Any,
        model: str,
        script: ChatScript,
        turn_i: int,
        history: list[dict[str, str]],
    ) -> tuple[RequestResult, str]:
        opts = self.options
        turn = script.turns[turn_i]
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": turn.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True
        if opts.api == "chat":
            body["messages"] = history
            endpoint = "/v1/chat/completions"
        else:
            body["prompt"] = "".join(m["content"] for m in history)
            endpoint = "/v1/completions"
        res = RequestResult(script.session_id, turn_i, ok=False, start_s=time.monotonic())
        parts: list[str] = []
        try:
            async with client.stream(
                "POST", endpoint, json=body, headers={"X-Session-Id": script.session_id}
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {text[:200]}"
                    return res, ""
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self._on_chunk(res, chunk, parts)
            res.ok = True
        except Exception as exc:  # a failed request is counted, the run goes on
            res.error = f"{type(exc).__name__}: {exc}"[:200]
        res.end_s = time.monotonic()
        return res, "".join(parts)

    @staticmethod
    def _on_chunk(res: RequestResult, chunk: dict[str, Any], parts: list[str]) -> None:
        if chunk.get("usage"):
            u = chunk["usage"]
            res.prompt_tokens = int(u.get("prompt_tokens") or 0)
            res.completion_tokens = int(u.get("completion_tokens") or 0)
            details = u.get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            if not text:
                continue
            parts.append(text)
            res.num_chunks += 1
            now = time.monotonic() - res.start_s
            res.chunk_s.append(now)
            if res.ttft_s is None:
                res.ttft_s = now
            elif res.second_token_s is None:
                res.second_token_s = now

    async def _run_script(
        self,
        client: Any,
        model: str,
        script: ChatScript,
        t0: float,
        out: LoadgenResult,
        on_request: Callable[[], None] | None,
    ) -> None:
        rng = random.Random(script.seed)
        history: list[dict[str, str]] = []
        started = None
        for i, turn in enumerate(script.turns):
            now = time.monotonic() - t0
            if self.options.duration_s is not None and now >= self.options.duration_s:
                break
            if turn.not_before_s > now:
                await asyncio.sleep(turn.not_before_s - now)
            started = started if started is not None else time.monotonic()
            history.append({"role": "user", "content": _words(rng, turn.append_words) + " "})
            res, reply = await self._request(client, model, script, i, history)
            out.requests.append(res)
            if on_request is not None:
                on_request()
            if not res.ok:
                break
            history.append({"role": "assistant", "content": reply})
        if started is not None:
            out.agent_jct_s.append(time.monotonic() - started)

    async def run(
        self, scripts: Sequence[ChatScript], on_request: Callable[[], None] | None = None
    ) -> LoadgenResult:
        import httpx

        out = LoadgenResult()
        limits = httpx.Limits(max_connections=self.options.concurrency + 4)
        headers = {"Authorization": f"Bearer {self.options.api_key}"}
        async with httpx.AsyncClient(
            base_url=self.options.url.rstrip("/"),
            timeout=self.options.timeout_s,
            limits=limits,
            headers=headers,
        ) as client:
            model = await self._model(client)
            sem = asyncio.Semaphore(self.options.concurrency)
            t0 = time.monotonic()

            async def one(script: ChatScript) -> None:
                async with sem:
                    await self._run_script(client, model, script, t0, out, on_request)

            await asyncio.gather(*(one(s) for s in scripts))
            out.wall_s = time.monotonic() - t0
        return out


def format_summary(s: dict[str, Any]) -> str:
    def ms(p: dict[str, float]) -> str:
        return f"p50 {p['p50'] * 1e3:8.1f} ms  p99 {p['p99'] * 1e3:8.1f} ms"

    return "\n".join(
        [
            f"requests {s['requests']}  errors {s['errors']}  wall {s['wall_s']:.1f} s  "
            f"{s['requests_per_s']:.2f} req/s  {s['output_tokens_per_s']:.1f} output tok/s",
            f"TTFT {ms(s['ttft_s'])}",
            f"TTST {ms(s['ttst_s'])}",
            f"TPOT {ms(s['tpot_s'])}",
            f"ITL  {ms(s['itl_s'])}",
            f"gap  {ms(s['chunk_gap_s'])}   (between streamed chunks: near 0 = bursts)",
            f"agent JCT p50 {s['agent_jct_s']['p50']:.2f} s  p99 {s['agent_jct_s']['p99']:.2f} s"
            f"  job JCT {s['job_jct_s']:.2f} s",
            f"hit ratio {s['hit_ratio']:.3f} ({s['cached_tokens']} of {s['prompt_tokens']} "
            "prompt tokens cached)",
        ]
    )
