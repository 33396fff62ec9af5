"""KV store: hash-chain addressing, atomic persisted Full Blocks, checksum-detected damage."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import pytest

from dualpath.kv.store import (
    HEADER_BYTES,
    BlockCorrupt,
    BlockLayout,
    BlockMissing,
    KVStore,
    block_keys,
    write_all,
)

LAYOUT = BlockLayout(num_layers=4, block_tokens=8, row_bytes=16)


def _payload(fill: int) -> bytes:
    return bytes((fill + i) % 256 for i in range(LAYOUT.full_block_bytes))


def test_keys_are_a_prefix_chain() -> None:
    a = block_keys(list(range(20)), 8, "ns")
    b = block_keys([*range(16), 99, 98], 8, "ns")
    assert len(a) == 2 and len(b) == 2  # trailing partial block has no key
    assert a == b  # same first 16 tokens ⇒ same keys
    assert block_keys([1, *range(1, 16)], 8, "ns")[1] != a[1]  # parent changes the child
    assert block_keys(list(range(16)), 8, "other") != a  # namespaces are disjoint


def test_layer_block_is_a_contiguous_slice() -> None:
    assert LAYOUT.full_block_bytes == 4 * 8 * 16
    assert LAYOUT.layer_offset(2, 3) == 2 * 8 * 16 + 3 * 16


def test_write_read_lookup_and_restart(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    keys = block_keys(list(range(24)), 8, "ns")
    assert store.lookup(keys) == 0
    assert store.write_block(keys[0], _payload(1))
    assert store.write_block(keys[1], _payload(2))
    assert not store.write_block(keys[1], _payload(2))  # already there
    assert store.lookup(keys) == 16
    restarted = KVStore(tmp_path, LAYOUT)  # a new process finds what was persisted
    out = bytearray(LAYOUT.full_block_bytes)
    restarted.read_block(keys[1], memoryview(out))
    assert bytes(out) == _payload(2)
    assert not list(tmp_path.rglob("*.tmp"))  # atomic: no temporaries left behind


def test_missing_and_corrupt_blocks_are_detected(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    key = block_keys(list(range(8)), 8, "ns")[0]
    out = memoryview(bytearray(LAYOUT.full_block_bytes))
    with pytest.raises(BlockMissing):
        store.read_block(key, out)
    store.write_block(key, _payload(3))
    raw = bytearray(store.path(key).read_bytes())
    raw[HEADER_BYTES + 100] ^= 0xFF  # flip one payload byte
    store.path(key).write_bytes(bytes(raw))
    with pytest.raises(BlockCorrupt, match="checksum"):
        store.read_block(key, out)
    store.path(key).write_bytes(bytes(raw[: HEADER_BYTES + 10]))  # truncated
    with pytest.raises(BlockCorrupt):
        store.read_block(key, out)


def test_direct_io_reads_into_aligned_memory(tmp_path: Path) -> None:
    layout = BlockLayout(num_layers=2, block_tokens=64, row_bytes=64)  # 8 KiB: 512-aligned
    store = KVStore(tmp_path, layout, direct_io=True)
    key = block_keys(list(range(64)), 64, "ns")[0]
    data = bytes(i % 251 for i in range(layout.full_block_bytes))
    store.write_block(key, data)
    page = mmap.mmap(-1, layout.full_block_bytes)  # page-aligned like a shared-memory slot
    store.read_block(key, memoryview(page))
    assert bytes(page) == data


def test_bad_sizes_are_rejected(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    with pytest.raises(ValueError, match="payload"):
        store.write_block("ab" * 16, b"x")
    with pytest.raises(ValueError, match="block_tokens"):
        BlockLayout(4, 0, 16)


def test_batched_calls_answer_per_block_as_single_ones(tmp_path: Path) -> None:
    """The store protocol's batch calls on files: per block what the single call gives (a
    stored block, one already there, a write error; a read, a miss, a corrupt block), the
    other blocks of the batch unaffected."""
    store = KVStore(tmp_path / "kv", LAYOUT)
    assert store.batched is False
    store.register(memoryview(bytearray(8)))  # nothing to register for files
    keys = ["k0", "k1", "k2"]
    store.write_block("k1", _payload(1))
    payloads = [memoryview(_payload(i)) for i in range(3)]
    assert store.write_blocks(keys, payloads) == [True, False, True]
    left = [1]

    def full_disk_once(fd: int, data: memoryview | bytes) -> None:
        if len(data) == LAYOUT.full_block_bytes and left[0]:  # the first payload: a full disk
            left[0] -= 1
            raise OSError(errno.ENOSPC, "no space (injected)")
        write_all(fd, data)

    full = store.with_write_fn(full_disk_once)  # one block's write fails, alone
    got = full.write_blocks(["k3", "k4"], [payloads[0], payloads[1]])
    assert isinstance(got[0], OSError) and got[0].errno == errno.ENOSPC and got[1] is True
    assert not store.has("k3") and store.has("k4")
    store.path("k2").write_bytes(store.path("k2").read_bytes()[:-1] + b"\x00")  # damaged
    outs = [memoryview(bytearray(LAYOUT.full_block_bytes)) for _ in range(4)]
    errs = store.read_blocks(["k0", "k1", "k2", "nope"], outs)
    assert errs[0] is None and errs[1] is None
    assert isinstance(errs[2], BlockCorrupt) and isinstance(errs[3], BlockMissing)
    assert bytes(outs[0]) == _payload(0) and bytes(outs[1]) == _payload(1)
    assert store.remove("k2") is True and store.remove("k2") is False
    assert store.lookup(["k0", "k1", "k2"]) == 2 * LAYOUT.block_tokens
    store.close()
