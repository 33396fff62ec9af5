"""One node's storage read queue and its PE/DE buffer (design §2, §4, §13.4–5).

Reads are served FIFO, ``reads_per_node`` at a time, as Full Blocks over the node's SNIC into
its buffer. A read starts only when its bytes fit in the buffer (backpressure; an empty buffer
always admits one read, so a request larger than the buffer cannot deadlock). Buffer bytes are
released by the shell when the KV leaves the buffer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

from dualpath.sim.request import Req
from dualpath.sim.transfers import Transfers
from dualpath.types import KVPath


class NodeIO:
    """Reports each read's start (``on_read_start(req, node, bytes)``) and end
    (``on_read_done(req, node)``); design §13.4's ``read_q`` is counted by the ledger."""

    def __init__(
        self,
        node_id: int,
        path_kind: KVPath,  # the node's read path: STORAGE_TO_PE_BUFFER or _DE_BUFFER
        read_path: tuple[int, ...],
        buffer_capacity_bytes: float,
        reads_at_once: int,
        transfers: Transfers,
        on_read_done: Callable[[Req, int], None],
        on_read_start: Callable[[Req, int, float], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.path_kind = path_kind
        self.read_path = read_path
        self.buffer_capacity_bytes = buffer_capacity_bytes
        self.reads_at_once = reads_at_once
        self.transfers = transfers
        self.on_read_done = on_read_done
        self.on_read_start = on_read_start
        self.queue: deque[tuple[Req, int, float]] = deque()
        self.in_flight = 0
        self.buffer_used_bytes = 0.0
        self.buffer_peak_bytes = 0.0
        # SNIC time lost to backpressure: no read in flight while the queue's head waits
        # for buffer space (a diagnostic; it changes no timing).
        self.buffer_blocked_s = 0.0
        self._blocked_since: float | None = None
        # SNIC time lost to a classic PE's HBM admission: no read in flight or queued while
        # requests of the node's PEs wait for HBM before they may read (a diagnostic).
        self.hbm_waiting = 0
        self.hbm_blocked_s = 0.0
        self._hbm_since: float | None = None

    def enqueue(self, req: Req, tokens: int, size_bytes: float) -> None:
        """Queue a read of ``tokens`` hit tokens (``size_bytes`` of Full Blocks) for ``req``."""
        self.queue.append((req, tokens, size_bytes))
        self.pump()

    def hold(self, size_bytes: float) -> None:
        """Put bytes into the buffer that did not come from storage (PE → DE KV sends)."""
        self.buffer_used_bytes += size_bytes
        if self.buffer_used_bytes > self.buffer_peak_bytes:
            self.buffer_peak_bytes = self.buffer_used_bytes

    def release(self, size_bytes: float) -> None:
        self.buffer_used_bytes -= size_bytes
        if self.buffer_used_bytes < 1e-6:
            self.buffer_used_bytes = 0.0
        self.pump()

    def note_hbm_waiting(self, delta: int) -> None:
        """``delta`` more (or fewer) requests of this node's PEs wait for HBM to read."""
        self.hbm_waiting += delta
        self._note_hbm()

    def _note_hbm(self) -> None:
        idle = self.hbm_waiting > 0 and self.in_flight == 0 and not self.queue
        if idle and self._hbm_since is None:
            self._hbm_since = self.transfers.loop.now
        elif not idle and self._hbm_since is not None:
            self.hbm_blocked_s += self.transfers.loop.now - self._hbm_since
            self._hbm_since = None

    def pump(self) -> None:
        """Start queued reads, in FIFO order, while slots and buffer space allow."""
        self._pump()
        if self.hbm_waiting or self._hbm_since is not None:
            self._note_hbm()

    def _pump(self) -> None:
        queue = self.queue
        while queue and self.in_flight < self.reads_at_once:
            req, tokens, size = queue[0]
            if self.buffer_used_bytes > 0 and self.buffer_used_bytes + size > (
                self.buffer_capacity_bytes
            ):
                # backpressure: the head waits for buffer space (FIFO)
                if self.in_flight == 0 and self._blocked_since is None:
                    self._blocked_since = self.transfers.loop.now
                return
            if self._blocked_since is not None:
                self.buffer_blocked_s += self.transfers.loop.now - self._blocked_since
                self._blocked_since = None
            queue.popleft()
            self.in_flight += 1
            self.hold(size)
            if self.on_read_start is not None:
                self.on_read_start(req, self.node_id, size)
            self.transfers.start(
                self.path_kind,
                self.read_path,
                size,
                partial(self._done, req, tokens),
            )

    def _done(self, req: Req, tokens: int) -> None:
        self.in_flight -= 1
        self.on_read_done(req, self.node_id)
        self.pump()
