"""KV transport throughput on this machine: plain memcpy vs shared memory, TCP and Mooncake.

Run: .venv/bin/python benchmarks/bench_transport.py [--mib 256 --repeat 3]
Prints GB/s for large copies and for 64 KiB Layer-Block-sized copies (what layerwise prefill
moves; 64 in flight). The peer region lives in another process; the shared-memory backend memcpys into its
segment, the TCP backend sends to the peer's listener on loopback, the Mooncake backend writes
over its TCP transport (metadata "P2PHANDSHAKE").
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import time
import uuid
from collections import deque
from typing import Any

import numpy as np

from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.transport.base import KVTransport, RegionHandle, Transfer
from dualpath.kv.transport.shm import ShmTransport

LAYER_BLOCK_BYTES = 64 * 1024  # 64 tokens × 1 KiB (tiny model, one layer)
IN_FLIGHT = 64  # Layer-Block transfers outstanding at once


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_memcpy(nbytes: int, repeat: int) -> tuple[float, float]:
    src = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    np.copyto(dst, src)  # fault the pages in
    best_big = best_small = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        best_big = max(best_big, _gbps(nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        for off in range(0, nbytes, LAYER_BLOCK_BYTES):
            np.copyto(dst[off : off + LAYER_BLOCK_BYTES], src[off : off + LAYER_BLOCK_BYTES])
        best_small = max(best_small, _gbps(nbytes, time.perf_counter() - t))
    return best_big, best_small


def bench_transport(
    tx: KVTransport, peer: RegionHandle, nbytes: int, repeat: int
) -> tuple[float, float]:
    mem = mmap.mmap(-1, nbytes)
    mem[:] = os.urandom(1024) * (nbytes // 1024)
    src = tx.register("bench-src", memoryview(mem))
    tx.write(src, 0, peer, 0, nbytes).wait()  # warm up: handshake, page faults
    best_big = best_small = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        tx.write(src, 0, peer, 0, nbytes).wait()
        best_big = max(best_big, _gbps(nbytes, time.perf_counter() - t))
        t = time.perf_counter()
        pending: deque[Transfer] = deque()
        for off in range(0, nbytes, LAYER_BLOCK_BYTES):
            if len(pending) == IN_FLIGHT:  # a sliding window, as a NIC's send queue would be
                pending.popleft().wait()
            pending.append(tx.write(src, off, peer, off, LAYER_BLOCK_BYTES))
        while pending:
            pending.popleft().wait()
        best_small = max(best_small, _gbps(nbytes, time.perf_counter() - t))
    return best_big, best_small


def _tcp_peer(nbytes: int, q: Any, stop: Any) -> None:
    from dualpath.kv.transport.tcp import TcpTransport

    tx = TcpTransport()
    region = mmap.mmap(-1, nbytes)
    q.put(tx.register("peer", memoryview(region)))
    stop.get()
    tx.close()


def bench_peer(target: Any, make: Any, nbytes: int, repeat: int) -> tuple[float, float]:
    """``make()``'s transport writing into a region of a peer process started by ``target``."""
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=target, args=(nbytes, q, stop), daemon=True)
    proc.start()
    try:
        peer = q.get(timeout=60)
        tx = make()
        result = bench_transport(tx, peer, nbytes, repeat)
        tx.close()
        return result
    finally:
        stop.put(None)
        proc.join(30)


def _mooncake_peer(nbytes: int, q: Any, stop: Any) -> None:
    from dualpath.kv.transport.mooncake import MooncakeTransport

    tx = MooncakeTransport()
    region = mmap.mmap(-1, nbytes)
    q.put(tx.register("peer", memoryview(region)))
    stop.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per measurement, MiB")
    ap.add_argument("--repeat", type=int, default=3, help="best of N")
    args = ap.parse_args()
    nbytes = args.mib * 1024 * 1024
    big, small = bench_memcpy(nbytes, args.repeat)
    print(f"plain memcpy (numpy, 1 core)     {big:6.2f} GB/s   64 KiB pieces {small:6.2f} GB/s")

    ctx = mp.get_context("spawn")
    spec = BufferSpec(f"bench-{uuid.uuid4().hex[:8]}", 1, nbytes)
    peer_buf = SlotBuffer.create(spec, ctx.Lock())
    try:
        tx = ShmTransport()
        big, small = bench_transport(
            tx, RegionHandle("shm", spec.name, 0, nbytes), nbytes, args.repeat
        )
        tx.close()
        print(f"shared-memory transport          {big:6.2f} GB/s   64 KiB pieces {small:6.2f} GB/s")
    finally:
        peer_buf.close()

    from dualpath.kv.transport.tcp import TcpTransport

    big, small = bench_peer(_tcp_peer, TcpTransport, nbytes, args.repeat)
    print(f"TCP transport (loopback)         {big:6.2f} GB/s   64 KiB pieces {small:6.2f} GB/s")

    try:
        from dualpath.kv.transport.mooncake import MooncakeTransport, load_engine_class

        load_engine_class()
    except ImportError as err:
        print(f"Mooncake transport               skipped: {err}")
        return
    big, small = bench_peer(_mooncake_peer, MooncakeTransport, nbytes, args.repeat)
    print(f"Mooncake transport (TCP, loopback) {big:4.2f} GB/s   64 KiB pieces {small:6.2f} GB/s")


if __name__ == "__main__":
    main()
