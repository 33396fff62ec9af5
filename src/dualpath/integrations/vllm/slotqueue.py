"""Requests waiting for a node buffer's slots, first come first served.

Slots come back from other processes (the side-car once a block is durable, the instances
when a decode's load is done), so a full buffer is polled; one task per node polls it for the
request at the head of the queue, not every waiting request on its own (400 waiters polling
every 5 ms took a seventh of the router's event loop), backing off while nothing frees and
woken at once when the router itself gives slots back (``kick``). Owns no slots: ``try_alloc``
and ``give_back`` are the flow's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

POLL_S = 0.005  # the first retry of a full buffer
POLL_MAX_S = 0.05  # retries back off to this while nothing frees


class SlotQueue:
    """One node buffer's waiters. ``try_alloc(num_slots, lease)``: the slots, or None while
    the buffer is full (an exception fails that waiter); ``give_back(slots, lease)``: slots a
    waiter that left was granted."""

    def __init__(
        self,
        try_alloc: Callable[[int, int], Awaitable[list[int] | None]],
        give_back: Callable[[list[int], int], object],
    ) -> None:
        self._try = try_alloc
        self._give_back = give_back
        self._waiting: deque[tuple[int, int, asyncio.Future[list[int]]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._waiting)

    async def alloc(self, num_slots: int, lease: int) -> list[int]:
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
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._give_back(fut.result(), lease)  # granted as its waiter left
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
            if fut.done():
                self._give_back(got, lease)
            else:
                fut.set_result(got)
