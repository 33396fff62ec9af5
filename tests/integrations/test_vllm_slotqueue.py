"""``slotqueue.SlotQueue``: waiters for a full buffer served first come first served by one
poller, woken at once by a give-back, and nothing granted to a waiter that left is lost."""

from __future__ import annotations

import asyncio

import pytest

from dualpath.integrations.vllm.slotqueue import SlotQueue


class Buffer:
    """A buffer of ``free`` slots; counts the tries (the polls)."""

    def __init__(self, free: int) -> None:
        self.free = list(range(free))
        self.tries = 0
        self.given_back: list[int] = []

    async def try_alloc(self, n: int, lease: int) -> list[int] | None:
        self.tries += 1
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        return got

    def give_back(self, slots: list[int], lease: int) -> None:
        self.given_back += slots
        self.free += slots


def test_waiters_are_served_in_arrival_order_by_one_poller() -> None:
    async def run() -> None:
        buf = Buffer(2)
        q = SlotQueue(buf.try_alloc, buf.give_back)
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
        assert buf.tries - tries <= 0.2 / 0.005  # one poller, backing off: not 3 per 5 ms
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
        q = SlotQueue(buf.try_alloc, buf.give_back)
        waiter = asyncio.create_task(q.alloc(1, 5))
        await asyncio.sleep(0.02)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        buf.free = [7]
        q.kick()
        await asyncio.sleep(0.05)
        assert buf.free == [7] and len(q) == 0  # nobody took it
        # a buffer that cannot be asked fails the waiter, not the queue
        failing = SlotQueue(_refuse, buf.give_back)
        with pytest.raises(OSError):
            await failing.alloc(1, 1)

    asyncio.run(run())


async def _refuse(n: int, lease: int) -> list[int] | None:
    raise OSError("side-car gone")
