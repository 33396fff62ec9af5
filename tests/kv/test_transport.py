"""KV transports: bytes land where they are addressed; shared memory and Mooncake backends."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import uuid
from typing import Any

import pytest

from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.transport import ShmTransport, make_transport
from dualpath.kv.transport.base import RegionHandle


def _pattern(n: int, seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(n))


def test_shm_write_and_read_between_processes_memory() -> None:
    spec = BufferSpec(f"dpt-{os.getpid()}-{uuid.uuid4().hex[:8]}", num_slots=2, slot_bytes=8192)
    peer = SlotBuffer.create(spec, mp.get_context("spawn").Lock())
    try:
        remote = RegionHandle("shm:peer", spec.name, 0, spec.data_bytes)
        tx = ShmTransport()
        local = memoryview(bytearray(_pattern(8192, 1)))
        src = tx.register("hbm", local)
        tx.write(src, 0, remote, peer.offset(1), 8192).wait()
        assert bytes(peer.slot(1)) == _pattern(8192, 1)
        peer.slot(0)[:100] = _pattern(100, 2)
        tx.read(src, 50, remote, 0, 100).wait()
        assert bytes(local[50:150]) == _pattern(100, 2)
        with pytest.raises(ValueError, match="invalid for region"):
            tx.write(src, 8000, remote, 0, 500)
        tx.close()
    finally:
        peer.close()


def test_unknown_transport_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="transport='nope'"):
        make_transport("nope")


def _mooncake_peer(q: Any, done: Any) -> None:
    from dualpath.kv.transport.mooncake import MooncakeTransport

    tx = MooncakeTransport()
    region = mmap.mmap(-1, 1 << 20)
    q.put(tx.register("de-buffer", memoryview(region)))
    want = done.get(timeout=60)
    q.put(bytes(region[: len(want)]) == want)


def test_mooncake_write_and_read_across_processes() -> None:
    try:
        from dualpath.kv.transport.mooncake import MooncakeTransport, load_engine_class

        load_engine_class()
    except ImportError as err:
        pytest.skip(f"Mooncake Transfer Engine not importable: {err}")
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_mooncake_peer, args=(q, done), daemon=True)
    proc.start()
    try:
        remote: RegionHandle = q.get(timeout=60)
        tx = MooncakeTransport()
        mem = mmap.mmap(-1, 1 << 20)
        data = _pattern(300_000, 5)
        mem[: len(data)] = data
        src = tx.register("hbm", memoryview(mem))
        tx.write(src, 0, remote, 0, len(data)).wait()
        tx.read(src, 500_000, remote, 1000, 2000).wait()
        assert bytes(mem[500_000:502_000]) == data[1000:3000]
        done.put(data)
        assert q.get(timeout=60) is True  # the peer sees the written bytes
        tx.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
