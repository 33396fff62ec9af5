"""``slotqueue.SlotQueue``: waiters for a full buffer served first come first served by one
task, woken at once by a kick (a give-back, a doorbell's ring), and what is granted to a
waiter that left is its lease's (the flow's ``try_alloc`` records every grant), not lost."""

from __future__ import annotations

import asyncio

import pytest

from dualpath.integrations.vllm.slotqueue import SlotQueue


class Buffer:
    """A buffer of ``free`` slots; counts the tries (the polls) and records each grant under
    its lease, as the flow's ``try_alloc`` does. ``gate``: a try waits for it (a side-car
    call still in flight)."""

    def __init__(self, free: int) -> None:
        self.free = list(range(free))
        self.tries = 0
        self.granted: dict[int, list[int]] = {}
        self.gate: asyncio.Event | None = None

    async def try_alloc(self, n: int, lease: int) -> list[int] | None:
        self.tries += 1
        if self.gate is not None:
            await self.gate.wait()
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        self.granted.setdefault(lease, []).extend(got)
        return got


def test_waiters_are_served_in_arrival_order_by_one_poller() -> None:
    async def run() -> None:
        buf = Buffer(2)
        q = SlotQueue(buf.try_alloc)
        assert await q.alloc(2, 1) == [0, 1]  # fits: at once
        order: list[int] = []

        async def wait(i: int, n: int) -> None:
            await q.alloc(n, i)
            order.append(i)

        tasks = [asyncio.create_task(wait(i, n)) for i, n in ((10, 2), (11, 1), (12, 1))]
        await asyncio.sleep(0.2)
        assert len(q) == 3 and order == []
        tries = buf.tries
        await asyncio.sleep(0.2)
        assert buf.tries - tries <= 0.2 / 0.05  # one task, backing off: not 3 per 50 ms
        buf.free += [0, 1]  # slots come back from another process
        q.kick()
        await asyncio.sleep(0.05)
        assert order == [10]  # the head takes both; the others wait behind it
        buf.free += [0, 1]
        q.kick()
        await asyncio.gather(*tasks)
        assert order == [10, 11, 12] and len(q) == 0

    asyncio.run(run())


def test_a_waiter_that_leaves_loses_no_slot() -> None:
    async def run() -> None:
        buf = Buffer(0)
        q = SlotQueue(buf.try_alloc)
        waiter = asyncio.create_task(q.alloc(1, 5))
        await asyncio.sleep(0.02)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        buf.free = [7]
        q.kick()
        await asyncio.sleep(0.05)
        assert buf.free == [7] and len(q) == 0  # nobody took it
        # a waiter that leaves while its try is in flight: the grant is its lease's
        buf.free = []
        late = asyncio.create_task(q.alloc(1, 6))
        await asyncio.sleep(0.02)  # its first try failed: it waits in the queue
        buf.gate = asyncio.Event()
        buf.free = [8]
        q.kick()
        await asyncio.sleep(0.02)  # that try waits for the gate
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        buf.gate.set()
        await asyncio.sleep(0.02)
        assert buf.granted[6] == [8] and buf.free == [] and len(q) == 0
        # a buffer that cannot be asked fails the waiter, not the queue
        failing: SlotQueue[int] = SlotQueue(_refuse)
        with pytest.raises(OSError):
            await failing.alloc(1, 1)

    asyncio.run(run())


async def _refuse(n: int, lease: int) -> list[int] | None:
    raise OSError("side-car gone")
