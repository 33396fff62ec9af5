"""Put / get throughput of Full Blocks: Mooncake Store (``MooncakeBlockStore``) beside the file
store (``KVStore``, a temporary directory), in one run on loopback.

Run: .venv/bin/python benchmarks/bench_mooncake_store.py [--blocks N]

For each block size (the tiny model's Full Block, and 1 MiB) and each path it writes N fresh
blocks one ``write_block`` at a time, then reads them back, and prints MB/s (10^6 bytes of
payload per second). Mooncake paths: ``bytes`` (unregistered memory: ``put_parts`` / ``get``,
one copy each way), ``zero-copy`` (a registered buffer standing in for the node buffer:
scatter-gather puts and gets), ``zero-copy batched`` (reads as one ``read_blocks`` call).
The file store fsyncs every block (durable on return); Mooncake holds blocks in the owner's
memory (the master and owner are started here, on loopback, TCP transport).
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable

from dualpath.config import MODEL_PRESETS
from dualpath.config.scheduler import SchedulerConfig
from dualpath.kv.mooncake_server import StoreServer
from dualpath.kv.mooncake_store import MooncakeBlockStore
from dualpath.kv.store import BlockLayout, KVStore, block_keys
from dualpath.net import free_port

HOST = "127.0.0.1"


def tiny_layout() -> BlockLayout:
    model = MODEL_PRESETS["tiny"]
    return BlockLayout(
        model.num_layers, SchedulerConfig().block_tokens, model.kv_bytes_per_token_per_layer
    )


def mib_layout() -> BlockLayout:
    return BlockLayout(num_layers=4, block_tokens=64, row_bytes=4096)  # 1 MiB


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    store: KVStore | MooncakeBlockStore, memory: memoryview, n: int, batched: bool, tag: str
) -> tuple[float, float]:
    """(put MB/s, get MB/s) of ``n`` fresh blocks held in ``memory`` (n + n blocks long)."""
    size = store.layout.full_block_bytes
    tokens = [hash((tag, i)) & 0x7FFFFFFF for i in range(n * store.layout.block_tokens)]
    keys = block_keys(tokens, store.layout.block_tokens, f"bench-{tag}-{time.time_ns()}")
    memory[: n * size] = os.urandom(n * size)
    blocks = [memory[i * size : (i + 1) * size] for i in range(n)]
    outs = [memory[(n + i) * size : (n + i + 1) * size] for i in range(n)]

    def put() -> None:
        for key, block in zip(keys, blocks, strict=True):
            if not store.write_block(key, block):
                raise RuntimeError(f"block {key} was already stored")

    def get() -> None:
        if batched and isinstance(store, MooncakeBlockStore):
            errors = store.read_blocks(keys, outs)
            if any(errors):
                raise RuntimeError(f"read failed: {errors}")
            return
        for key, out in zip(keys, outs, strict=True):
            store.read_block(key, out)

    put_s, get_s = timed(put), timed(get)
    if memory[: n * size] != memory[n * size : 2 * n * size]:
        raise RuntimeError("blocks read back differ from those written")
    return n * size / put_s / 1e6, n * size / get_s / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per size and path")
    args = parser.parse_args()
    n = args.blocks
    layouts = {"tiny Full Block": tiny_layout(), "1 MiB": mib_layout()}
    biggest = max(lay.full_block_bytes for lay in layouts.values())
    segment = 2 * len(layouts) * 3 * n * (biggest + 4096) + (64 << 20)  # every block fits
    rows: list[tuple[str, str, int, float, float]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-kv-") as root,
        StoreServer().start(HOST, free_port(HOST), segment) as server,
    ):
        node_buffer = mmap.mmap(-1, 2 * n * biggest)
        plain = bytearray(2 * n * biggest)
        for label, layout in layouts.items():
            size = layout.full_block_bytes
            file_store = KVStore(os.path.join(root, label.replace(" ", "_")), layout)
            rows.append(
                (
                    "file (fsync)",
                    label,
                    size,
                    *measure(file_store, memoryview(plain), n, False, "f" + label),
                )
            )
            with MooncakeBlockStore.connect(server.master_address, layout, "bench") as store:
                rows.append(
                    (
                        "mooncake bytes",
                        label,
                        size,
                        *measure(store, memoryview(plain), n, False, "b" + label),
                    )
                )
                store.register(memoryview(node_buffer))
                for batched, name in (
                    (False, "mooncake zero-copy"),
                    (True, "mooncake zero-copy batched"),
                ):
                    tag = f"z{batched}{label}"
                    rows.append(
                        (
                            name,
                            label,
                            size,
                            *measure(store, memoryview(node_buffer), n, batched, tag),
                        )
                    )
    print(f"{n} blocks per row, loopback (TCP transport), {os.cpu_count()} CPUs")
    print(f"{'path':<28} {'block':<16} {'bytes':>8} {'put MB/s':>9} {'get MB/s':>9}")
    for name, label, size, put, get in rows:
        print(f"{name:<28} {label:<16} {size:>8} {put:>9.0f} {get:>9.0f}")


if __name__ == "__main__":
    main()
