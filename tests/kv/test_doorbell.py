"""``kv.doorbell``: a process that frees slots of a node buffer wakes the one that waits for
them, through a FIFO, with nothing polling; a ring with nobody listening is a no-op."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import tempfile
import threading
import uuid
from pathlib import Path

from dualpath.kv import doorbell
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.pacer import LinkLock


def _spec() -> BufferSpec:
    return BufferSpec(f"dpt-{os.getpid()}-{uuid.uuid4().hex[:8]}", 4, 1000)


def _free_in_child(spec: BufferSpec, lock_path: str, bell: str, slots: list[int]) -> None:
    buf = SlotBuffer.attach(spec, LinkLock(lock_path))
    buf.on_free = doorbell.Doorbell(bell).ring
    try:
        buf.release(slots, 7)
    finally:
        buf.close()


def test_a_free_in_another_process_wakes_the_listener() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lock, bell = str(Path(tmp) / "b.lock"), str(Path(tmp) / "b.lock.free")
        Path(lock).touch()
        doorbell.make(bell)
        doorbell.make(bell)  # (again: the FIFO kept)
        spec = _spec()
        buf = SlotBuffer.create(spec, LinkLock(lock))
        buf.on_free = doorbell.Doorbell(bell).ring
        listener = doorbell.Listener(bell)
        try:
            slots = buf.alloc(4, owner=7)
            assert slots is not None
            assert buf.transfer(slots[:1], 7, 8)  # frees nothing: no ring
            assert select.select([listener], [], [], 0.2)[0] == []
            child = mp.get_context("spawn").Process(
                target=_free_in_child, args=(spec, lock, bell, slots)
            )
            child.start()
            child.join(60)
            assert child.exitcode == 0
            assert select.select([listener], [], [], 10)[0] == [listener]
            assert listener.drain() >= 1 and buf.num_free == 3
            assert listener.drain() == 0  # drained: not readable again until the next ring
        finally:
            listener.close()
            buf.close()


def test_ringing_with_nobody_listening_or_no_doorbell_is_a_no_op() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        bell = str(Path(tmp) / "x.free")
        doorbell.Doorbell(bell).ring()  # no FIFO at all
        Path(bell).write_text("stale")  # a file in the way is replaced by the FIFO
        doorbell.make(bell)
        ringer = doorbell.Doorbell(bell)
        ringer.ring()  # a FIFO nobody reads
        listener = doorbell.Listener(bell, blocking=True)
        woke: list[int] = []
        waiter = threading.Thread(target=lambda: woke.append(listener.wait()))
        waiter.start()
        ringer.ring()
        waiter.join(10)
        assert woke and woke[0] >= 1
        for _ in range(70_000):  # a listener that does not read: the pipe fills, rings go on
            ringer.ring()
        assert listener.wait() > 0
        listener.close()
        ringer.ring()  # the listener left: the write end goes, no error
        ringer.ring()
        ringer.close()
