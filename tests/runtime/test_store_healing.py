"""A block path that cannot be written is healed, not retried and logged forever: whatever
stands in its way (a directory at the block's path, a file where its directory should be,
something unreadable there) is moved under ``<root>/.quarantine`` and the block written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.kv.store import QUARANTINE, BlockLayout, BlockUnreadable, KVStore
from dualpath.kv.worker import persist_with_retry, read_or_miss

LAYOUT = BlockLayout(2, 4, 8)
KEY = "ab" * 16
PAYLOAD = bytes(range(LAYOUT.full_block_bytes))


def _readback(store: KVStore) -> bytes:
    out = memoryview(bytearray(LAYOUT.full_block_bytes))
    store.read_block(KEY, out)
    return bytes(out)


def test_a_directory_at_the_block_path_is_moved_aside_and_the_block_written(
    tmp_path: Path,
) -> None:
    store = KVStore(tmp_path, LAYOUT)
    squatter = store.path(KEY)
    squatter.mkdir(parents=True)
    (squatter / "junk").write_text("x")  # not empty: os.replace cannot take its place
    assert persist_with_retry(store, KEY, memoryview(PAYLOAD), backoff_s=0.0) is None
    assert _readback(store) == PAYLOAD
    moved = list((tmp_path / QUARANTINE).iterdir())
    assert len(moved) == 1 and (moved[0] / "junk").read_text() == "x"


def test_a_file_where_the_shard_directory_should_be(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    store.path(KEY).parent.write_text("not a directory")
    assert store.write_block(KEY, PAYLOAD)
    assert _readback(store) == PAYLOAD
    assert len(list((tmp_path / QUARANTINE).iterdir())) == 1


def test_an_unreadable_block_is_a_miss_moved_aside(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    store.path(KEY).mkdir(parents=True)  # has() says no; a read that gets here anyway:
    with pytest.raises(BlockUnreadable, match="Is a directory"):
        _readback(store)
    assert not store.path(KEY).exists()  # out of the way: the next write succeeds
    assert not read_or_miss(store, KEY, memoryview(bytearray(LAYOUT.full_block_bytes)))
    assert store.write_block(KEY, PAYLOAD) and _readback(store) == PAYLOAD


def test_a_path_that_cannot_be_cleared_fails_without_retries(tmp_path: Path) -> None:
    store = KVStore(tmp_path, LAYOUT)
    store.path(KEY).mkdir(parents=True)
    store.quarantine = lambda path: False  # type: ignore[method-assign]  # (a read-only mount)
    attempts = []
    real = store._write

    def counted(final: Path, payload: memoryview | bytes) -> bool:
        attempts.append(final)
        return real(final, payload)

    store._write = counted  # type: ignore[method-assign]
    err = persist_with_retry(store, KEY, memoryview(PAYLOAD), backoff_s=10.0)  # no sleep
    assert isinstance(err, IsADirectoryError)
    assert len(attempts) == 1  # EISDIR is not retried: the write queue behind it goes on


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_directory_at_a_block_path_heals_in_a_real_run(tmp_path: Path) -> None:
    """A directory planted at the path of turn 0's first Full Block: the run writes the
    block anyway (the directory moved aside), and a second run hits it."""
    from dualpath.kv.store import block_keys
    from dualpath.runtime.env import kv_namespace
    from dualpath.runtime.options import RuntimeOptions
    from dualpath.runtime.session import Runtime
    from dualpath.workload.scripts import AgentScript

    from .conftest import reference_outputs, small_config

    cfg = small_config()
    block = cfg.scheduler.block_tokens
    prompt = tuple(range(1, 2 * block + 6))
    agents = [AgentScript(0, (prompt,), (4,))]
    opts = RuntimeOptions(system="basic", kv_root=str(tmp_path))
    key = block_keys(list(prompt), block, kv_namespace(cfg, 0))[0]
    first = KVStore(tmp_path, LAYOUT).path(key)
    first.mkdir(parents=True)
    (first / "junk").write_text("x")
    with Runtime(cfg, opts) as rt:
        assert rt.run(agents).outputs == reference_outputs(cfg, agents)
    assert first.is_file()  # healed: the block is on disk
    with Runtime(cfg, replace(opts)) as rt:
        again = rt.run(agents)
    assert again.outputs == reference_outputs(cfg, agents)
    assert again.records[0].hit_tokens >= block
