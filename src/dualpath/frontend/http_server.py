"""The HTTP server both OpenAI front ends run under (``dualpath serve`` over our runtime, the
vLLM router): uvicorn on h11 with ``frontend/guard.py``'s connection hygiene and
``frontend/logs.py``'s rate-limited log, stopping gracefully on SIGINT / SIGTERM."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dualpath.frontend.guard import ConnectionLimits, Guard
from dualpath.frontend.logs import RepeatFilter


def graceful_server(config: Any) -> tuple[Any, list[int]]:
    """A ``uvicorn.Server`` for ``config`` that, stopped by SIGINT / SIGTERM, returns from
    ``run()`` (its lifespan's shutdown done) instead of re-raising the signal, and the list
    where the signals that stopped it are put."""
    import uvicorn

    stopped_by: list[int] = []

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                # shut down gracefully: exit 0 instead of re-raising SIGINT / SIGTERM
                stopped_by.extend(self._captured_signals)
                self._captured_signals.clear()

    return _Server(config), stopped_by


@dataclass(slots=True)
class HttpServer:
    """A guarded, gracefully stopping uvicorn server (``serve``, and the vLLM router)."""

    server: Any  # uvicorn.Server
    stopped_by: list[int]  # the signals that stopped it
    guard: Guard
    log_filter: RepeatFilter

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.log_filter.flush()


def http_server(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    graceful_s: float,
    limits: ConnectionLimits | None = None,
) -> HttpServer:
    """uvicorn serving ``app`` on h11 with ``frontend/guard.py``'s connection hygiene and
    ``frontend/logs.py``'s rate-limited log."""
    import uvicorn

    from dualpath.frontend import logs
    from dualpath.frontend.guard import GuardCollector, guarded_protocol

    limits = limits or ConnectionLimits()
    guard = Guard(limits)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(max(1, graceful_s)),
        timeout_keep_alive=max(1, round(limits.keepalive_s)),
        access_log=False,
        http=guarded_protocol(guard),
        ws="none",
    )
    server, stopped_by = graceful_server(config)
    log_filter = logs.install()
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    if metrics is not None:  # /metrics shows the connections and the held log records
        metrics.registry.register(GuardCollector(guard, log_filter))
    return HttpServer(server, stopped_by, guard, log_filter)
