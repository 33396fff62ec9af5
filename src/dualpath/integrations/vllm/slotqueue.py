"""Requests waiting for a node buffer's slots, first come first served.

Slots come back from other processes (the side-car once a block is durable, the instances
when a decode's load is done or a prefill's pins end), each of which rings the buffer's
doorbell (``kv.doorbell``): the flow listens to it and ``kick``s the node's queue, as it does
when the router itself gives slots back. One task per node tries the request at the head of
the queue, not every waiting request on its own (400 waiters polling every 5 ms took a
seventh of the router's event loop); between kicks it retries on a slow backoff, a safety net
only. A networked node's side-car waits for free slots itself (``alloc`` with ``wait_s``).
Owns no slots: ``try_alloc`` is the flow's, and what it grants is the asking request's lease
from that moment on, even when its waiter has left meanwhile (the request's one exit gives it
back).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

# retries of a full buffer with no kick in between (a kick, from the doorbell or the router's
# own release, tries at once): a safety net, e.g. for a ring that came before the queue
# listened
POLL_S = 0.05
POLL_MAX_S = 1.0
L = TypeVar("L")  # a lease: what the slots are asked for under


class SlotQueue(Generic[L]):
    """One node buffer's waiters. ``try_alloc(num_slots, lease)``: the slots (granted to
    ``lease``), or None while the buffer is full (an exception fails that waiter)."""

    def __init__(self, try_alloc: Callable[[int, L], Awaitable[list[int] | None]]) -> None:
        self._try = try_alloc
        self._waiting: deque[tuple[int, L, asyncio.Future[list[int]]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._waiting)

    async def alloc(self, num_slots: int, lease: L) -> list[int]:
        """``num_slots`` slots under ``lease``: at once when nobody waits and they fit, else
        in arrival order. Cancel it (a deadline, the client gone) to leave the queue."""
        if not self._waiting and (got := await self._try(num_slots, lease)) is not None:
            return got
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((num_slots, lease, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve())
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:  # (granted as its waiter left: the lease has them)
            fut.cancel()
            raise

    def kick(self) -> None:
        """Slots were given back: try the head of the queue now."""
        self._wake.set()

    async def _serve(self) -> None:
        wait = POLL_S
        while self._waiting:
            num_slots, lease, fut = self._waiting[0]
            if fut.done():  # its waiter left
                self._waiting.popleft()
                continue
            self._wake.clear()  # (a kick while it tries ends the wait below at once)
            try:
                got = await self._try(num_slots, lease)
            except Exception as err:  # the buffer cannot be asked: this waiter fails
                self._waiting.popleft()
                if not fut.done():
                    fut.set_exception(err)
                continue
            if got is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                wait = min(wait * 2, POLL_MAX_S)
                continue
            self._waiting.popleft()
            wait = POLL_S
            if not fut.done():  # (else its waiter left: the lease it asked for has them)
                fut.set_result(got)
