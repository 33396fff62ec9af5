"""A classic (non-layerwise) PE's HBM admission (design §8, §11): which of the requests
assigned to the PE may start their storage reads and join a forward pass.

Owns the PE's HBM reservations and its read-ahead; it starts nothing itself (the caller's
``start`` starts a request's reads, ``ready`` hands a request to the PE's queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.sim.request import Req


@dataclass(slots=True)
class _Entry:
    req: Req
    read_bytes: float
    start: Callable[[], None] | None  # starts the request's storage reads (None: nothing to read)
    started: bool = False
    done: bool = False


class HbmAdmission:
    """One classic PE's admission, FIFO over the requests assigned to it.

    A request is *admitted* when the KV of its whole prompt (cached + new tokens, every
    layer: the classic pass holds the batch's KV for all layers, design §8) is reserved in the
    PE's HBM budget; its storage read starts then, and it joins a forward pass once both are
    true (admitted, read done). ``release`` frees the reservation after the request's last
    pass, whose send to the DE ends the classic pass. Beyond the admitted requests, the next
    ones in FIFO order may start their reads early (into the PE buffer) while they stay
    within ``read_ahead_requests`` requests or ``read_ahead_bytes`` of read bytes (either
    allowance; both 0: the classic engine, no read before allocation). A request whose
    prompt exceeds the budget can never be prefilled by a classic engine (every chunk
    attends over all earlier KV, so chunking does not shrink the resident KV): ``offer``
    refuses it with a ValueError.

    ``on_blocked(delta)`` reports changes in the number of requests whose reads wait for
    admission (the node's diagnostic "SNIC idle while HBM is full").
    """

    def __init__(
        self,
        pe: int,
        budget_tokens: int,
        read_ahead_requests: int,
        read_ahead_bytes: float,
        ready: Callable[[Req], None],
        on_blocked: Callable[[int], None] | None = None,
    ) -> None:
        if budget_tokens < 1:
            raise ValueError(f"budget_tokens={budget_tokens} is invalid: must be >= 1")
        self.pe = pe
        self.budget_tokens = budget_tokens
        self.read_ahead_requests = read_ahead_requests
        self.read_ahead_bytes = read_ahead_bytes
        self.ready = ready
        self.on_blocked = on_blocked
        self.reserved_tokens = 0
        self.peak_reserved_tokens = 0
        self.pending: deque[_Entry] = deque()  # assigned, not admitted (FIFO)
        self._ahead = 0  # pending entries (a prefix) whose reads started early
        self._ahead_requests = 0  # of those, the ones with bytes to read
        self._ahead_bytes = 0.0
        self._admitted: dict[int, _Entry] = {}  # admitted, read not done yet

    def offer(self, req: Req, read_bytes: float, start: Callable[[], None] | None) -> None:
        """``req`` was assigned to this PE; ``start`` starts its reads (None: no hit KV)."""
        if req.prompt_tokens > self.budget_tokens:
            raise ValueError(
                f"request {req.request_id} (agent {req.agent_id}, turn {req.turn_index}): "
                f"prompt_tokens={req.prompt_tokens} exceeds PE {self.pe}'s HBM KV budget of "
                f"{self.budget_tokens} tokens; a non-layerwise (classic) engine holds the "
                "whole prompt's KV in HBM during its pass and cannot prefill it (use a "
                "layerwise system or more HBM)"
            )
        entry = _Entry(req, read_bytes, start, started=start is None, done=start is None)
        self.pending.append(entry)
        if start is not None and self.on_blocked is not None:
            self.on_blocked(1)
        self._pump()

    def read_done(self, req: Req) -> None:
        """All of ``req``'s reads landed."""
        entry = self._admitted.pop(req.request_id, None)
        if entry is not None:
            self.ready(req)
            return
        for e in self.pending:  # a read-ahead request, not admitted yet
            if e.req is req:
                e.done = True
                return
        raise ValueError(f"request {req.request_id}: read done but never offered to PE {self.pe}")

    def release(self, req: Req) -> None:
        """``req``'s last pass (and its send to the DE) ended: free its HBM."""
        self.reserved_tokens -= req.prompt_tokens
        self._pump()

    def _start(self, entry: _Entry) -> None:
        entry.started = True
        if self.on_blocked is not None:
            self.on_blocked(-1)
        if entry.start is not None:
            entry.start()

    def _pump(self) -> None:
        pending = self.pending
        while pending and self.reserved_tokens + pending[0].req.prompt_tokens <= (
            self.budget_tokens
        ):
            entry = pending.popleft()
            req = entry.req
            self.reserved_tokens += req.prompt_tokens
            if self.reserved_tokens > self.peak_reserved_tokens:
                self.peak_reserved_tokens = self.reserved_tokens
            if self._ahead:
                self._ahead -= 1
                if entry.start is not None:
                    self._ahead_requests -= 1
                    self._ahead_bytes -= entry.read_bytes
            if entry.done:
                self.ready(req)
                continue
            self._admitted[req.request_id] = entry
            if not entry.started:
                self._start(entry)
        # read-ahead: the next requests in FIFO order, while an allowance holds
        while self._ahead < len(pending):
            entry = pending[self._ahead]
            if entry.start is not None:
                fits = self._ahead_requests < self.read_ahead_requests or (
                    self._ahead_bytes + entry.read_bytes <= self.read_ahead_bytes
                )
                if not fits:
                    break
                self._ahead_requests += 1
                self._ahead_bytes += entry.read_bytes
                self._start(entry)
            self._ahead += 1
