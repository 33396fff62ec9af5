"""What the router's operator watches besides the DualPath counters: an access log line per
request (status and duration, 5xx with the error's message) and the event loop's lag.

``AccessLog`` is ASGI middleware (no I/O but one write per request); ``LoopLag`` a background
task that measures how late the loop wakes up and a Prometheus collector of what it measured:
a router whose loop runs late answers ``/health`` late and delays every stream's events.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

QUIET = ("/health", "/metrics")  # probes and scrapes: logged only when they fail
_ERROR_PEEK = 2048  # bytes of a 5xx answer read for its message


class AccessLog:
    """One line per request once its answer is complete (a stream: its end), to ``out``:
    ``client "METHOD path" status duration ms [x-request-id] [the 5xx's message]``."""

    def __init__(self, app: ASGIApp, out: TextIO | None = None) -> None:
        self.app = app
        self.out = out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        peek = b""

        async def sending(message: Message) -> None:
            nonlocal status, peek
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 500 and not peek:
                peek = bytes(message.get("body", b""))[:_ERROR_PEEK]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status = status or 500
            raise
        finally:
            path = scope.get("path", "")
            if status >= 300 or path not in QUIET:
                self._write(scope, status, time.perf_counter() - start, peek)

    def _write(self, scope: Scope, status: int, seconds: float, peek: bytes) -> None:
        client = scope.get("client") or ("-", 0)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode(errors="replace")
        line = (
            f'dualpath router: {client[0]}:{client[1]} "{scope.get("method", "")} '
            f'{scope.get("path", "")}" {status or "-"} {seconds * 1e3:.1f} ms'
        )
        if rid:
            line += f" x-request-id={rid}"
        if status >= 500:
            line += f" error={error_message(peek)!r}"
        out = self.out or sys.stderr
        out.write(line + "\n")
        out.flush()


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error answer (its first bytes otherwise)."""
    try:
        err = json.loads(body).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


# histogram buckets of the loop's lag, seconds
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag(Collector):
    """How late the event loop runs: every ``interval_s`` a sleep is timed, its overshoot is
    the lag (what any callback — a ``/health`` answer, a stream's next event — waited
    beyond its turn). ``run`` is the task; ``collect`` the Prometheus view."""

    def __init__(
        self, interval_s: float = 0.05, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.sum_s = 0.0
        self.max_s = 0.0

    def record(self, lag_s: float) -> None:
        self.counts[bisect.bisect_left(LAG_BUCKETS, lag_s)] += 1
        self.sum_s += lag_s
        self.max_s = max(self.max_s, lag_s)

    async def run(self) -> None:
        while True:
            start = self.clock()
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, self.clock() - start - self.interval_s))

    def collect(self) -> Iterator[Metric]:
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip([*map(str, LAG_BUCKETS), "+Inf"], self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        yield HistogramMetricFamily(
            "dualpath:router_event_loop_lag_seconds",
            "How late the router's event loop ran, sampled every interval",
            buckets=buckets,
            sum_value=self.sum_s,
        )
        yield GaugeMetricFamily(
            "dualpath:router_event_loop_lag_max_seconds",
            "The longest event-loop lag seen since the start",
            value=self.max_s,
        )
