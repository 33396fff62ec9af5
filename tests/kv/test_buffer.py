"""Shared-memory PE/DE buffers: slots shared across processes, backpressure when full."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest

from dualpath.kv.buffer import BufferSpec, SlotBuffer


def _spec(num_slots: int = 4) -> BufferSpec:
    return BufferSpec(
        name=f"dpt-{os.getpid()}-{uuid.uuid4().hex[:8]}", num_slots=num_slots, slot_bytes=1000
    )


def _child_fill_and_free(buf: SlotBuffer, q: mp.Queue) -> None:  # type: ignore[type-arg]
    slots = buf.alloc(2)
    assert slots is not None
    buf.slot(slots[0])[:3] = b"abc"
    q.put(slots)
    q.get()  # wait until told to free
    buf.free(slots)


def test_slots_are_shared_and_backpressure_waits_for_free() -> None:
    ctx = mp.get_context("spawn")
    buf = SlotBuffer.create(_spec(3), ctx.Lock())
    try:
        q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        back: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        proc = ctx.Process(target=_child_fill_and_free, args=(buf, back))
        proc.start()
        child_slots = back.get(timeout=30)
        assert bytes(buf.slot(child_slots[0])[:3]) == b"abc"  # same memory
        assert buf.num_free == 1
        assert buf.alloc(2) is None  # full: refused, not dropped
        mine = buf.alloc(1)
        assert mine is not None and mine[0] not in child_slots
        back.put("free")
        got = buf.alloc_wait(2, timeout_s=30)  # waits until the child frees
        assert sorted(got) == sorted(child_slots)
        proc.join(30)
        assert proc.exitcode == 0
        del q
    finally:
        buf.close()


def test_alloc_errors() -> None:
    buf = SlotBuffer.create(_spec(2), mp.get_context("spawn").Lock())
    try:
        assert buf.alloc(0) == []
        with pytest.raises(ValueError, match="capacity"):
            buf.alloc(3)
        slots = buf.alloc(1)
        assert slots is not None
        buf.free(slots)
        with pytest.raises(ValueError, match="freed twice"):
            buf.free(slots)
        with pytest.raises(TimeoutError):
            buf.alloc(2)
            buf.alloc_wait(1, timeout_s=0.01)
    finally:
        buf.close()
    assert _spec().stride_bytes % 4096 == 0


def test_a_pinned_slot_released_by_its_holder_is_freed_when_its_pin_ends() -> None:
    """The router (lease 7) releases slots a prefill instance (tag -1) still writes: they stay
    in use, out of every allocation, until the instance unpins them (or dies)."""
    buf = SlotBuffer.create(_spec(4), mp.get_context("spawn").Lock())
    try:
        slots = buf.alloc(3, owner=7)
        assert slots == [0, 1, 2]
        assert not buf.pin([0, 3], 7, -1)  # all or none: slot 3 is not the lease's
        assert buf.pin([0, 1], 7, -1)
        with pytest.raises(ValueError, match="pinner"):
            buf.pin([2], 7, 0)
        assert buf.release(slots, 7) == 3
        assert buf.num_free == 2  # slot 2 free at once; 0 and 1 still written
        assert buf.alloc(3) is None
        assert buf.unpin([0, 1], -2) == 0  # another instance's unpin ends nothing
        assert buf.unpin([0], -1) == 1
        assert buf.num_free == 3 and buf.owner_of(1) is not None
        assert buf.release_owner(-1) == 0  # the pinner died: its last pin ends with it
        assert buf.num_free == 4
        # a pin that ends before its holder releases: the holder frees the slot then
        got = buf.alloc(1, owner=8)
        assert got is not None and buf.pin(got, 8, -1)
        assert buf.unpin(got, -1) == 1 and buf.num_free == 3
        assert buf.release(got, 8) == 1 and buf.num_free == 4
    finally:
        buf.close()
