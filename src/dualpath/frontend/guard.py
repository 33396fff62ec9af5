"""Connection hygiene in front of the app, as a production front end does it: a deadline for a
request's headers and one between two reads of its body, a cap on open connections (and on
one client's), keep-alive limits, and every malformed framing answered in OpenAI's error shape.

uvicorn (0.55) reads headers and bodies without a deadline and counts connections only when
a request is complete, so one client with enough idle half-sent requests holds every
descriptor of the process. ``GuardedH11`` is uvicorn's own h11 protocol with the missing
checks; ``Guard`` is the state its connections share. When the cap is reached, the oldest
connection that holds no request (idle keep-alive, or headers not yet complete) is closed to
make room; when every connection holds a request, the new one is refused with a 503 — a
request already accepted is never failed to let another in. The cap is kept below the
process's descriptor limit (raised to its hard limit at start), so descriptors never run out
on account of HTTP connections.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dualpath.frontend.schema import error_body

LINGER_S = 1.0  # after an error reply: read and drop what the client still sends, then close
# descriptors kept for everything but client connections (the runtime's pipes, shared
# memory, store files, the log): the cap is at most the descriptor limit less this
FD_RESERVE = 256


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """``max_connections`` / ``max_per_client`` open connections (0: no per-client cap; a
    client is its IP address); ``header_timeout_s`` for a request's headers from its first
    byte (or from the connection's start); ``body_timeout_s`` between two reads of a body;
    ``keepalive_s`` idle between requests; ``keepalive_requests`` per connection."""

    max_connections: int = 2048
    max_per_client: int = 512
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    keepalive_s: float = 75.0  # longer than clients keep idle connections (aiohttp: 15-60 s)
    keepalive_requests: int = 1000

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections} is invalid: must be >= 1")
        if self.max_per_client < 0:
            raise ValueError(
                f"--max-connections-per-client {self.max_per_client} is invalid: must be >= 0"
            )
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {getattr(self, name)} is invalid: must be > 0")
        if self.keepalive_requests < 1:
            raise ValueError(
                f"--keepalive-requests {self.keepalive_requests} is invalid: must be >= 1"
            )


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


def raw_error(status: int, reason: str, message: str, param: str | None = None) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape that closes the connection (for the
    cases where no request cycle exists to answer through)."""
    body = json.dumps(error_body(status, message, param)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """The connections of one server, oldest first, and the counters ``/metrics`` shows."""

    def __init__(self, limits: ConnectionLimits, fd_limit: int | None = None) -> None:
        self.limits = limits
        fds = fd_limit if fd_limit is not None else raise_fd_limit()
        self.max_connections = max(1, min(limits.max_connections, fds - FD_RESERVE))
        self.open: OrderedDict[GuardedH11, None] = OrderedDict()
        self.per_client: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # why connections were closed or refused

    def count(self, why: str) -> None:
        self.counts[why] = self.counts.get(why, 0) + 1

    def admit(self, conn: GuardedH11) -> bool:
        """Register ``conn``; make room by closing the oldest connection without a request
        (of the same client when the client's cap is the one reached); False: refuse it."""
        client = conn.client_key
        cap = self.limits.max_per_client
        if cap and self.per_client.get(client, 0) >= cap and not self._evict(client):
            return False
        if len(self.open) >= self.max_connections and not self._evict(None):
            return False
        self.open[conn] = None
        self.per_client[client] = self.per_client.get(client, 0) + 1
        return True

    def release(self, conn: GuardedH11) -> None:
        if self.open.pop(conn, 1) is None:
            n = self.per_client.get(conn.client_key, 1) - 1
            if n > 0:
                self.per_client[conn.client_key] = n
            else:
                self.per_client.pop(conn.client_key, None)

    def _evict(self, client: str | None) -> bool:
        for conn in self.open:
            if (client is None or conn.client_key == client) and conn.is_waiting:
                self.release(conn)
                conn.close_idle()
                self.count("evicted")
                return True
        return False


class GuardCollector:
    """``/metrics``: open connections, and those closed or refused by why (a Prometheus
    collector over ``guard``)."""

    def __init__(self, guard: Guard, held: Any = None) -> None:
        self.guard = guard
        self.held = held  # a logs.RepeatFilter: log records held back

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = self.guard
        yield GaugeMetricFamily(
            "dualpath:connections_open", "Open HTTP connections", value=len(g.open)
        )
        closed = CounterMetricFamily(
            "dualpath:connections_closed",
            "HTTP connections closed or refused by the server, by why",
            labels=["reason"],
        )
        for why in sorted(g.counts):
            closed.add_metric([why], g.counts[why])
        yield closed
        if self.held is not None:
            yield CounterMetricFamily(
                "dualpath:log_records_held",
                "Log records not written (repeats, over the rate limit)",
                value=self.held.held,
            )


def guarded_protocol(guard: Guard) -> type[H11Protocol]:
    """uvicorn's ``http=`` protocol class whose connections share ``guard``."""
    return type("GuardedH11", (GuardedH11,), {"guard": guard})


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with deadlines, the connection cap and OpenAI-shaped framing
    errors (see the module docstring)."""

    guard: Guard  # set by ``guarded_protocol``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.guard.limits.keepalive_s  # type: ignore[assignment]
        self.client_key = ""
        self._timer: asyncio.TimerHandle | None = None
        self._requests = 0
        self._received = 0  # bytes of the request being read
        self._admitted = False
        self._lingering = False
        self._framing_error = ""
        next_event = self.conn.next_event

        def remember_errors() -> Any:  # h11's reason for a 400, which uvicorn drops
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._framing_error = str(exc)
                raise

        self.conn.next_event = remember_errors  # type: ignore[method-assign]

    # -- state -------------------------------------------------------------------------
    @property
    def in_request(self) -> bool:
        """A request is being read or answered on this connection."""
        return self.cycle is not None and not self.cycle.response_complete

    @property
    def is_waiting(self) -> bool:
        """No request held: idle keep-alive, or headers not complete (safe to close)."""
        return not self.in_request and self.conn.their_state is h11.IDLE

    def _arm(self, delay_s: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, self._expired, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.client_key = self.client[0] if self.client else ""
        if not self.guard.admit(self):
            self.guard.count("refused")
            self._linger(
                raw_error(
                    503,
                    "Service Unavailable",
                    "the server has too many open connections; retry later",
                )
            )
            return
        self._admitted = True
        self._arm(self.guard.limits.header_timeout_s, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._admitted:
            self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered already: what the client still sends is dropped
        idle = self.is_waiting and self._received == 0
        self._received += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._arm(self.guard.limits.body_timeout_s, "body")  # rearmed on every read
        elif state is h11.IDLE and not self.in_request:
            if idle and self._timer is None:  # a request's first bytes after keep-alive
                self._arm(self.guard.limits.header_timeout_s, "header")
        else:
            self._disarm()  # whole request in: the app answers within request_timeout_s

    def eof_received(self) -> None:
        if self._lingering:
            self.transport.close()
        elif self.conn.their_state is h11.SEND_BODY and self.cycle is not None:
            self._reject(400, "Bad Request", "the request body ended before its Content-Length")

    # -- uvicorn hooks -----------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        detail = self._framing_error or msg
        self.guard.count("malformed")
        self._linger(raw_error(400, "Bad Request", f"invalid HTTP request: {detail}"))

    def on_response_complete(self) -> None:
        self._requests += 1
        self._received = 0
        if self._requests >= self.guard.limits.keepalive_requests:
            self.server_state.total_requests += 1
            self.transport.close()
            return
        super().on_response_complete()

    # -- closing -----------------------------------------------------------------------
    def close_idle(self) -> None:
        """Close a connection that holds no request (to make room for a new one)."""
        self._admitted = False
        self._disarm()
        if self._received:
            self._linger(
                raw_error(
                    408,
                    "Request Timeout",
                    "the server needed this connection; its request was not complete",
                )
            )
        else:
            self.transport.close()

    def _expired(self, why: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.guard.count(f"{why}_timeout")
        if why == "body":
            limit = self.guard.limits.body_timeout_s
            self._reject(408, "Request Timeout", f"no request body bytes for {limit:g} s")
        elif self._received:
            limit = self.guard.limits.header_timeout_s
            self._reject(408, "Request Timeout", f"request headers not complete in {limit:g} s")
        else:
            self.transport.close()  # a connection that never sent a byte: nothing to answer

    def _reject(self, status: int, reason: str, message: str) -> None:
        """Answer the request being read (nothing of it reached a backend: the body is not
        complete) and close; the app, waiting for the body, sees a disconnect."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.response_started = True  # nothing more of the app reaches the socket
            cycle.disconnected = True
            cycle.message_event.set()
        elif cycle is not None:
            self.transport.close()
            return
        self._linger(raw_error(status, reason, message))

    def _linger(self, reply: bytes) -> None:
        """Send ``reply`` and close gracefully: our side of the stream ends, what the client
        still sends is read and dropped for ``LINGER_S`` (closing with unread bytes would
        reset the connection, and the client could lose the reply)."""
        self._disarm()
        self._lingering = True
        self.transport.write(reply)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)
