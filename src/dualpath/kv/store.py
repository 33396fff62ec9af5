"""Persistent KV store (design §2–§3): file-backed Full Blocks addressed by the prefix hash chain.

One file per Full Block: a 4 KiB header (magic, version, layers, tokens, row bytes, payload
bytes, crc32 of the payload, the 16-byte namespace fingerprint) then the layer-major payload
``[layers, tokens, row_bytes]``, so a Layer Block is a contiguous slice. Writes are atomic and
durable (temporary file, fsync, ``os.replace``, fsync of the directory) before
``write_block`` returns. Reads verify the header and checksum and raise ``BlockMissing`` /
``BlockCorrupt`` (callers recompute); a block of another namespace (other model, weights,
dtype, block size, layout or tenant) is a miss, never a hit. Files are 0600, dirs 0700. Owns no
pacing: the node's storage worker puts reads and writes through its SNIC pacer.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

MAGIC = b"DPKV"
VERSION = 2  # layout version: part of every namespace fingerprint and of every block header
HEADER_BYTES = 4096  # page-aligned payload: O_DIRECT reads land straight in a buffer slot
_HEADER = struct.Struct("<4sHIIIQI16s")
FINGERPRINT_BYTES = 16
DEFAULT_ROOT = "./.dualpath/kv"


class KVStoreError(Exception):
    """A block cannot be used; the caller recomputes its tokens."""


class BlockMissing(KVStoreError):
    pass


class BlockCorrupt(KVStoreError):
    pass


class BlockForeign(KVStoreError):
    """The block belongs to another namespace (fingerprint mismatch): a miss, left in place."""


class BlockUnreadable(KVStoreError):
    """Something at the block's path that cannot be read (a directory, a file this process
    may not open): a miss; it is moved aside (``KVStore.quarantine``) so the block can be
    written again."""


QUARANTINE = ".quarantine"  # under the root: what stood in a block's way (never looked up)
# write errors that mean the path is in the way (a directory at the block's path, a file at
# its directory's): moving the obstacle aside and writing again fixes them
_IN_THE_WAY = (IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError)


def fingerprint(namespace: str) -> bytes:
    """16-byte digest of a namespace, stored in every block header and checked on read."""
    return hashlib.blake2b(namespace.encode(), digest_size=FINGERPRINT_BYTES).digest()


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of one Full Block: ``num_layers × block_tokens × row_bytes`` bytes."""

    num_layers: int
    block_tokens: int
    row_bytes: int  # KV bytes of one token in one layer

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "row_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")

    @property
    def layer_block_bytes(self) -> int:
        return self.block_tokens * self.row_bytes

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    def layer_offset(self, layer: int, token_in_block: int = 0) -> int:
        """Byte offset of (layer, token) inside a Full Block."""
        return layer * self.layer_block_bytes + token_in_block * self.row_bytes


def write_all(fd: int, data: memoryview | bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (a short write goes on where it stopped)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def block_keys(tokens: Sequence[int], block_tokens: int, namespace: str) -> list[str]:
    """Hash-chain keys of every *full* block of ``tokens`` (a trailing partial block has none).

    key_i = blake2b(key_{i-1} ‖ token ids of block i); key_{-1} = blake2b(namespace)."""
    parent = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    keys: list[str] = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        chunk = struct.pack(f"<{block_tokens}i", *tokens[start : start + block_tokens])
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent.hex())
    return keys


# how a block file's bytes reach the file: ``write_all``, or a fault-injecting stand-in
WriteFn = Callable[[int, memoryview | bytes], None]


def block_header(layout: BlockLayout, crc: int, fingerprint: bytes, size: int) -> bytes:
    """A block's header (magic, version, layout, payload bytes, CRC32, namespace fingerprint),
    zero-padded to ``size`` bytes: the file store's and Mooncake Store's objects carry it."""
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        layout.num_layers,
        layout.block_tokens,
        layout.row_bytes,
        layout.full_block_bytes,
        crc,
        fingerprint,
    )
    return head.ljust(size, b"\0")


E = TypeVar("E", bound=BaseException)


def bare(err: E) -> E:
    """``err`` without its traceback, cause and context: their frames hold the caller's
    buffer (a view of a node buffer's shared memory, which could then not be closed; a frame
    and its exception also form a cycle that lives until the next garbage collection)."""
    err.__context__ = err.__cause__ = None
    return err.with_traceback(None)


class BlockPath(Protocol):
    """Where a block lives, as far as its readers care: it can be removed (a corrupt one)."""

    def unlink(self, missing_ok: bool = False) -> None: ...

    def is_file(self) -> bool: ...


class BlockStore(Protocol):
    """What the storage workers and side-cars need of a store of Full Blocks: ``KVStore``
    (files), ``mooncake_store.MooncakeBlockStore`` (Mooncake Store across the network).
    ``batched``: whether one call for many blocks saves round trips (``read_blocks``,
    ``write_blocks``); a store without that gain does them block by block."""

    layout: BlockLayout
    batched: bool

    def path(self, key: str) -> BlockPath: ...

    def has(self, key: str) -> bool: ...

    def lookup(self, keys: Sequence[str]) -> int: ...

    def write_block(self, key: str, payload: memoryview | bytes) -> bool: ...

    def read_block(self, key: str, out: memoryview) -> None: ...

    def write_blocks(
        self, keys: Sequence[str], payloads: Sequence[memoryview]
    ) -> list[bool | OSError]: ...

    def read_blocks(
        self, keys: Sequence[str], outs: Sequence[memoryview]
    ) -> list[KVStoreError | None]: ...

    def remove(self, key: str) -> bool: ...

    def register(self, memory: memoryview) -> None: ...

    def close(self) -> None: ...


class KVStore:
    """Full Blocks under ``root`` (a local directory or a shared file-system mount).

    ``write_fn`` writes each block file's header, then its payload (``write_all``; a test
    or ``FaultPlan.fail_writes`` injects failing writes here, see ``worker.FailingWrites``)."""

    batched = False  # a file per block: nothing is saved by asking for several at once

    def __init__(
        self,
        root: str | Path,
        layout: BlockLayout,
        direct_io: bool = False,
        namespace: str = "",
        write_fn: WriteFn = write_all,
    ) -> None:
        self.root = Path(root)
        self.layout = layout
        self.direct_io = direct_io
        self.fingerprint = fingerprint(namespace)
        self.write_fn = write_fn

    def with_write_fn(self, write_fn: WriteFn) -> KVStore:
        """The same store (root, layout, namespace) writing through ``write_fn``."""
        other = KVStore(self.root, self.layout, self.direct_io, write_fn=write_fn)
        other.fingerprint = self.fingerprint
        return other

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.kvb"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def lookup(self, keys: Sequence[str]) -> int:
        """Hit tokens: how many leading blocks of the chain are persisted, in tokens."""
        hits = 0
        for key in keys:
            if not self.has(key):
                break
            hits += 1
        return hits * self.layout.block_tokens

    def _header(self, crc: int) -> bytes:
        return block_header(self.layout, crc, self.fingerprint, HEADER_BYTES)

    def write_block(self, key: str, payload: memoryview | bytes) -> bool:
        """Persist one Full Block atomically; False if it already exists (content-addressed)."""
        if len(payload) != self.layout.full_block_bytes:
            raise ValueError(
                f"payload of {len(payload)} bytes is invalid: must be {self.layout.full_block_bytes}"
            )
        final = self.path(key)
        if final.is_file():
            return False
        try:
            return self._write(final, payload)
        except _IN_THE_WAY as err:
            if not self._clear_way(final):
                raise
            try:
                return self._write(final, payload)
            except OSError:
                raise err from None  # the first cause is the one to report

    def _write(self, final: Path, payload: memoryview | bytes) -> bool:
        self._make_dirs(final.parent)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                self.write_fn(fd, self._header(zlib.crc32(payload)))
                self.write_fn(fd, payload)
                os.fsync(fd)  # the bytes are on disk before the name points at them
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # no temporary file outlives a failed write
            raise
        fsync_dir(final.parent)  # the rename itself is durable: only now is the block acked
        return True

    def _clear_way(self, final: Path) -> bool:
        """Move aside what stands at ``final`` (anything but a readable block file) or at a
        directory above it that is not a directory; whether anything moved."""
        if final.exists() and not final.is_file():
            return self.quarantine(final)
        parent = final.parent
        if parent.exists() and not parent.is_dir():
            return self.quarantine(parent)
        return False

    def write_blocks(
        self, keys: Sequence[str], payloads: Sequence[memoryview]
    ) -> list[bool | OSError]:
        """``write_block`` for each; per block True (stored), False (already stored) or the
        OSError its write failed with."""
        out: list[bool | OSError] = []
        for key, payload in zip(keys, payloads, strict=True):
            try:
                out.append(self.write_block(key, payload))
            except OSError as err:
                out.append(bare(err))
        return out

    def read_blocks(
        self, keys: Sequence[str], outs: Sequence[memoryview]
    ) -> list[KVStoreError | None]:
        """``read_block`` for each; per block None (read and verified) or its error."""
        out: list[KVStoreError | None] = []
        for key, buf in zip(keys, outs, strict=True):
            try:
                self.read_block(key, buf)
                out.append(None)
            except KVStoreError as err:
                out.append(bare(err))
        return out

    def remove(self, key: str) -> bool:
        """Remove a block (a corrupt one, so that the recomputed block is stored again);
        whether one was there."""
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def register(self, memory: memoryview) -> None:
        """Nothing to do: files are read into and written from any memory."""

    def close(self) -> None:
        """Nothing held open between calls."""

    def quarantine(self, path: Path) -> bool:
        """Move ``path`` (a file or a directory in the store) under ``<root>/.quarantine``,
        out of every lookup; whether it moved."""
        aside = self.root / QUARANTINE
        try:
            aside.mkdir(mode=0o700, exist_ok=True)
            os.rename(path, aside / f"{path.name}.{os.getpid()}.{time.time_ns()}")
        except OSError:
            return False
        return True

    def _make_dirs(self, path: Path) -> None:
        """Create the store's directories 0700 (the umask cannot widen them)."""
        if path.is_dir():
            return
        self._make_dirs(path.parent)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            return
        os.chmod(path, 0o700)
        fsync_dir(path.parent)

    def read_block(self, key: str, out: memoryview) -> None:
        """Read and verify one Full Block into ``out`` (exactly ``full_block_bytes``)."""
        lay = self.layout
        if len(out) != lay.full_block_bytes:
            raise ValueError(f"out of {len(out)} bytes is invalid: must be {lay.full_block_bytes}")
        path = self.path(key)
        try:
            fd = self._open(path)
        except FileNotFoundError:
            raise BlockMissing(f"block {key} is not in the store ({path})") from None
        except OSError as err:  # a directory, a file we may not open: move it aside
            self.quarantine(path)
            raise BlockUnreadable(f"block {key}: {err.strerror} ({path})") from None
        try:
            head = self._read_header_direct(fd) if self.direct_io else os.pread(fd, HEADER_BYTES, 0)
            got = os.preadv(fd, [out], HEADER_BYTES)  # O_DIRECT: ``out`` must be page-aligned
            if not self.direct_io:  # keep the page cache out of storage measurements
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as err:  # e.g. a directory (opens, but reads fail)
            self.quarantine(path)
            raise BlockUnreadable(f"block {key}: {err.strerror} ({path})") from None
        finally:
            os.close(fd)
        self._verify(key, head, got, out)

    def _open(self, path: Path) -> int:
        if self.direct_io and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as err:
                if isinstance(err, FileNotFoundError):
                    raise
                self.direct_io = False  # file system without O_DIRECT (tmpfs): fall back
        return os.open(path, os.O_RDONLY)

    @staticmethod
    def _read_header_direct(fd: int) -> bytes:
        import mmap

        page = mmap.mmap(-1, HEADER_BYTES)
        try:
            os.preadv(fd, [page], 0)
            return bytes(page[:HEADER_BYTES])
        finally:
            page.close()

    def _verify(self, key: str, head: bytes, got: int, out: memoryview) -> None:
        lay = self.layout
        if len(head) < _HEADER.size:
            raise BlockCorrupt(f"block {key}: truncated header")
        magic, version, layers, tokens, row, size, crc, fp = _HEADER.unpack_from(head)
        expect = (MAGIC, VERSION, lay.num_layers, lay.block_tokens, lay.row_bytes)
        if (magic, version, layers, tokens, row) != expect:
            raise BlockCorrupt(f"block {key}: header {(magic, version, layers, tokens, row)}")
        if size != lay.full_block_bytes or got != size:
            raise BlockCorrupt(f"block {key}: {got} payload bytes, expected {size}")
        if zlib.crc32(out) != crc:
            raise BlockCorrupt(f"block {key}: checksum mismatch")
        if fp != self.fingerprint:
            raise BlockForeign(f"block {key}: written under another namespace")
