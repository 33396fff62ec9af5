"""MooncakeBlockStore against a real master and owner on loopback: the file store's guarantees
(round trip, hits only for stored blocks, content addressing, foreign / corrupt / missing
blocks), both transfer paths, ``open_store``, ``StoreServer`` and clean errors when a process
of the store dies."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.kv.store import (
    BlockCorrupt,
    BlockForeign,
    BlockLayout,
    BlockMissing,
    BlockUnreadable,
    KVStore,
    KVStoreError,
    block_keys,
)
from dualpath.kv.worker import persist_with_retry, read_or_miss

pytest.importorskip("mooncake.store", reason="mooncake is not installed")

from dualpath.kv.mooncake_server import StoreServer
from dualpath.kv.mooncake_store import (
    OBJECT_HEADER_BYTES,
    MooncakeBlockStore,
    load_client_class,
)
from dualpath.kv.stores import open_store
from dualpath.net import free_port

HOST = "127.0.0.1"
LAYOUT = BlockLayout(num_layers=2, block_tokens=4, row_bytes=64)
SIZE = LAYOUT.full_block_bytes


def start_server() -> StoreServer:
    try:
        return StoreServer().start(HOST, free_port(HOST), 32 << 20)
    except (OSError, RuntimeError) as err:
        pytest.skip(f"mooncake master cannot start: {err}")


@pytest.fixture(scope="module")
def server() -> Iterator[StoreServer]:
    with start_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def store(server: StoreServer) -> Iterator[MooncakeBlockStore]:
    with MooncakeBlockStore.connect(server.master_address, LAYOUT, "tenant-a") as st:
        yield st


@pytest.fixture
def shm(store: MooncakeBlockStore) -> Iterator[memoryview]:
    """Registered memory standing in for the node buffer (registered once per store)."""
    if not hasattr(store, "_test_memory"):
        memory = mmap.mmap(-1, 64 * SIZE)
        store.register(memoryview(memory))
        store._test_memory = memory  # type: ignore[attr-defined]  # lives as long as the store
    yield memoryview(store._test_memory)  # type: ignore[attr-defined]


def keys_of(seed: int, n: int) -> list[str]:
    tokens = list(range(seed * 1000, seed * 1000 + n * LAYOUT.block_tokens))
    return block_keys(tokens, LAYOUT.block_tokens, f"test-{os.getpid()}")


def test_round_trip_through_bytes(store: MooncakeBlockStore) -> None:
    (key,) = keys_of(1, 1)
    payload = os.urandom(SIZE)
    assert store.write_block(key, payload)
    out = bytearray(SIZE)
    store.read_block(key, memoryview(out))
    assert bytes(out) == payload


def test_round_trip_through_registered_memory(store: MooncakeBlockStore, shm: memoryview) -> None:
    keys = keys_of(2, 3)
    for i, key in enumerate(keys):
        shm[i * SIZE : (i + 1) * SIZE] = os.urandom(SIZE)
        assert store.write_block(key, shm[i * SIZE : (i + 1) * SIZE])
    outs = [shm[(10 + i) * SIZE : (11 + i) * SIZE] for i in range(3)]
    assert store.read_blocks(keys, outs) == [None, None, None]
    for i in range(3):
        assert outs[i] == shm[i * SIZE : (i + 1) * SIZE]
    loose = bytearray(SIZE)  # a block stored zero-copy reads through the bytes path too
    store.read_block(keys[0], memoryview(loose))
    assert loose == shm[:SIZE]


def test_a_batch_of_writes_is_one_put_per_new_block(
    store: MooncakeBlockStore, shm: memoryview
) -> None:
    keys = keys_of(20, 4)
    for i in range(4):
        shm[(20 + i) * SIZE : (21 + i) * SIZE] = os.urandom(SIZE)
    views = [shm[(20 + i) * SIZE : (21 + i) * SIZE] for i in range(4)]
    assert store.write_block(keys[1], views[1])  # one of them is stored already
    loose = memoryview(bytearray(views[3]))  # and one lies in memory not registered
    assert store.write_blocks(keys, [views[0], views[1], views[2], loose]) == [
        True,
        False,
        True,
        True,
    ]
    assert store.lookup(keys) == 4 * LAYOUT.block_tokens
    outs = [shm[(30 + i) * SIZE : (31 + i) * SIZE] for i in range(4)]
    assert store.read_blocks(keys, outs) == [None] * 4
    assert [bytes(o) for o in outs] == [bytes(v) for v in views]
    with pytest.raises(ValueError, match="payload"):
        store.write_blocks(keys[:1], [views[0][:10]])


def test_lookup_counts_leading_stored_blocks(store: MooncakeBlockStore) -> None:
    keys = keys_of(3, 4)
    for key in (keys[0], keys[1], keys[3]):
        store.write_block(key, os.urandom(SIZE))
    assert store.lookup(keys) == 2 * LAYOUT.block_tokens
    assert store.lookup([]) == 0
    assert store.has(keys[3]) and not store.has(keys[2])


def test_existing_block_is_not_put_again(store: MooncakeBlockStore) -> None:
    (key,) = keys_of(4, 1)
    first = os.urandom(SIZE)
    assert store.write_block(key, first)
    assert not store.write_block(key, os.urandom(SIZE))
    out = bytearray(SIZE)
    store.read_block(key, memoryview(out))
    assert bytes(out) == first


def test_block_in_flight_is_not_a_hit(store: MooncakeBlockStore) -> None:
    """A put started (space allocated) but not ended is invisible: no hit, a miss on read."""
    (key,) = keys_of(5, 1)
    assert store.client.batch_put_session_start([key], [OBJECT_HEADER_BYTES + SIZE]) == [0]
    try:
        assert not store.has(key)
        assert store.lookup([key]) == 0
        with pytest.raises(BlockMissing):
            store.read_block(key, memoryview(bytearray(SIZE)))
    finally:
        store.client.batch_put_session_revoke([key])


def test_block_of_another_namespace_is_foreign_and_kept(
    server: StoreServer, store: MooncakeBlockStore, shm: memoryview
) -> None:
    (key,) = keys_of(6, 1)
    with MooncakeBlockStore.connect(server.master_address, LAYOUT, "tenant-b") as other:
        assert other.write_block(key, os.urandom(SIZE))
    with pytest.raises(BlockForeign):
        store.read_block(key, memoryview(bytearray(SIZE)))
    with pytest.raises(BlockForeign):
        store.read_block(key, shm[:SIZE])
    assert not read_or_miss(store, key, shm[:SIZE])  # type: ignore[arg-type]
    assert store.has(key)  # another tenant's block is a miss, never removed


@pytest.mark.parametrize("registered", [False, True])
def test_corrupt_object_is_removed_and_stored_again(
    store: MooncakeBlockStore, shm: memoryview, registered: bool
) -> None:
    bad_size, bad_crc = keys_of(7 + registered, 2)
    store.client.put(bad_size, b"garbage" * 9)  # not a block at all
    good = os.urandom(SIZE)
    assert store.write_block(bad_crc, good)
    flipped = bytearray(store.client.get(bad_crc))
    flipped[-1] ^= 0xFF
    store.remove(bad_crc)
    store.client.put(bad_crc, bytes(flipped))  # a sound header, a payload bit flipped
    out = shm[:SIZE] if registered else memoryview(bytearray(SIZE))
    for key in (bad_size, bad_crc):
        with pytest.raises(BlockCorrupt):
            store.read_block(key, out)
        assert not read_or_miss(store, key, out)  # type: ignore[arg-type]
        assert not store.has(key)  # removed, so the recomputed block is stored again
        assert store.write_block(key, good)
        store.read_block(key, out)
        assert bytes(out) == good


def test_missing_block(store: MooncakeBlockStore, shm: memoryview) -> None:
    (key,) = keys_of(9, 1)
    for out in (memoryview(bytearray(SIZE)), shm[:SIZE]):
        with pytest.raises(BlockMissing):
            store.read_block(key, out)
        assert not read_or_miss(store, key, out)  # type: ignore[arg-type]
    assert not store.remove(key)


def test_persist_with_retry(store: MooncakeBlockStore, shm: memoryview) -> None:
    (key,) = keys_of(10, 1)
    shm[:SIZE] = os.urandom(SIZE)
    assert persist_with_retry(store, key, shm[:SIZE]) is None  # type: ignore[arg-type]
    assert persist_with_retry(store, key, shm[:SIZE]) is None  # type: ignore[arg-type]
    out = memoryview(bytearray(SIZE))
    assert read_or_miss(store, key, out)  # type: ignore[arg-type]
    assert out == shm[:SIZE]


def test_wrong_sizes_are_rejected(store: MooncakeBlockStore) -> None:
    with pytest.raises(ValueError, match="payload"):
        store.write_block("k", b"short")
    with pytest.raises(ValueError, match="out of"):
        store.read_block("k", memoryview(bytearray(3)))


def test_open_store_by_url(server: StoreServer, tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "a"), LAYOUT), KVStore)
    file_store = open_store(f"file://{tmp_path}/b", LAYOUT, "ns")
    assert isinstance(file_store, KVStore) and file_store.root == tmp_path / "b"
    with open_store(server.url, LAYOUT, "ns") as remote:  # type: ignore[union-attr]
        assert isinstance(remote, MooncakeBlockStore)
        assert remote.lookup(keys_of(11, 1)) == 0


@pytest.mark.parametrize(
    "url", ["", "ftp://x/y", "mooncake://host", "mooncake://h:port", "mooncake://:5/", "file://"]
)
def test_open_store_rejects_bad_url(url: str) -> None:
    with pytest.raises(ValueError, match="store url") as err:
        open_store(url, LAYOUT)
    assert "\n" not in str(err.value)


def test_unreachable_master_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="not reachable"):
        open_store(f"mooncake://{HOST}:{free_port(HOST)}", LAYOUT)
    assert time.monotonic() - start < 5


def test_missing_mooncake_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match="pip install mooncake") as err:
        load_client_class()
    assert "\n" not in str(err.value)


def test_taken_port_is_one_line_error(server: StoreServer) -> None:
    with pytest.raises(OSError, match=f"port {server.port} on {HOST} is taken"):
        StoreServer().start(HOST, server.port, 16 << 20)


def test_dead_owner_gives_clean_errors() -> None:
    with start_server() as srv:
        st = MooncakeBlockStore.connect(srv.master_address, LAYOUT, "t", timeout_s=5.0)
        try:
            keys = keys_of(12, 2)
            assert st.write_block(keys[0], os.urandom(SIZE))
            srv.kill_owner()
            with pytest.raises(BlockUnreadable):
                st.read_block(keys[0], memoryview(bytearray(SIZE)))
            assert not read_or_miss(st, keys[0], memoryview(bytearray(SIZE)))  # type: ignore[arg-type]
            err = persist_with_retry(st, keys[1], os.urandom(SIZE), attempts=1)  # type: ignore[arg-type]
            assert isinstance(err, OSError)
        finally:
            st.close()


def test_dead_master_gives_clean_errors_in_bounded_time() -> None:
    with start_server() as srv:
        st = MooncakeBlockStore.connect(srv.master_address, LAYOUT, "t", timeout_s=1.0)
        try:
            (key,) = keys_of(13, 1)
            assert st.write_block(key, os.urandom(SIZE))
            srv.kill_master()
            start = time.monotonic()
            with pytest.raises(KVStoreError):
                st.read_block(key, memoryview(bytearray(SIZE)))
            assert st.lookup([key]) == 0
            with pytest.raises(OSError):
                st.write_block(keys_of(14, 1)[0], os.urandom(SIZE))
            assert time.monotonic() - start < 10  # each call bounded by timeout_s
        finally:
            st.close()
    assert srv.master is None and srv.owner is None


def test_stop_leaves_no_process() -> None:
    srv = start_server()
    group = srv.master.pid if srv.master else 0
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


def test_serve_cli_runs_until_sigterm() -> None:
    port = free_port(HOST)
    cmd = [sys.executable, "-m", "dualpath.kv.mooncake_server", "serve"]
    proc = subprocess.Popen(
        [*cmd, "--host", HOST, "--port", str(port), "--segment-mib", "16"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"mooncake://{HOST}:{port}" in line
        with open_store(f"mooncake://{HOST}:{port}", LAYOUT) as st:  # type: ignore[union-attr]
            (key,) = keys_of(15, 1)
            assert st.write_block(key, os.urandom(SIZE))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()
