"""Full Blocks in Mooncake Store: ``MooncakeBlockStore``, the ``KVStore`` interface over a
Mooncake master (the server: ``mooncake_server.StoreServer``, a master and one memory owner).

One object per Full Block, under its hash-chain key: a 64-byte header (the file store's header
fields: magic, version, layout, payload bytes, crc32, namespace fingerprint) then the payload.
Header and payload travel in one put, so a block is never half there: Mooncake's put is
PutStart (allocate) → transfer → PutEnd, and an object is visible (``is_exist``, ``get``) only
after PutEnd; a writer that dies in between leaves an invisible allocation the master discards
(``put_start_discard_timeout_sec``). Memory registered with ``register`` moves zero-copy: the
header scatters into / gathers from a small registered scratch, the payload straight from / to
the caller's memory (one object, not a header key beside it: two puts could leave one without
the other; benchmarks/bench_mooncake_store.py: batched zero-copy reads ~1.0–1.3 GB/s on loopback,
the copying ``get`` path 0.5–0.8). A corrupt block is removed (``remove``; ``path(key).unlink``
for ``worker.read_or_miss``). Owns no pacing and no retries (``persist_with_retry`` retries).

Mooncake return codes relied on (``mooncake-store/include/types.h``): -200 no space
(NO_AVAILABLE_HANDLE), -600 buffer too small / invalid params, -703 replica not ready (a put in
flight), -704 OBJECT_NOT_FOUND, -705 OBJECT_ALREADY_EXISTS, -706 OBJECT_HAS_LEASE (a ``get``
leases an object for ``default_kv_lease_ttl``; ``remove`` forces past it), -707 LEASE_EXPIRED,
-800 TRANSFER_FAIL (the owner is gone, or the object's size differs from the buffers),
-900 RPC_FAIL (the master is gone: ~4 s of reconnects), -901 RPC_TIMEOUT (a hung master: 30 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import socket
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from dualpath.kv.store import _HEADER as FILE_HEADER  # the file store's header fields
from dualpath.kv.store import (
    MAGIC,
    VERSION,
    BlockCorrupt,
    BlockForeign,
    BlockLayout,
    BlockMissing,
    BlockUnreadable,
    KVStoreError,
    block_header,
    fingerprint,
)

OBJECT_HEADER_BYTES = 64  # FILE_HEADER (46 bytes) padded: no O_DIRECT alignment to keep here
LOCAL_BUFFER_BYTES = 64 << 20  # the client's own buffer: what the bytes path copies through
CALL_TIMEOUT_S = 10.0  # bound on one Mooncake call (a hung owner blocks a get forever)
CONNECT_TIMEOUT_S = 30.0  # setup (it retries an unreachable master for 90 s: probed first)
HEADER_SLOTS = 256  # registered header scratch: concurrent zero-copy blocks, all threads
MAX_BATCH = 64  # keys per batched call (a batch takes that many header slots)
CALL_THREADS = 4  # threads that run Mooncake calls (each bounded by ``timeout_s``)

OK, NO_SPACE, NOT_FOUND, ALREADY_EXISTS = 0, -200, -704, -705

T = TypeVar("T")


class MooncakeError(OSError):
    """A Mooncake call failed (``code``: its return code, 0 for a timeout): an ``OSError``,
    so ``persist_with_retry`` retries it (or not: a full store is ``ENOSPC``)."""

    def __init__(self, what: str, code: int, err: int = errno.EIO) -> None:
        super().__init__(err, f"mooncake {what}: {'timed out' if code == 0 else f'code {code}'}")
        self.code = code


def load_client_class() -> Any:
    """``MooncakeDistributedStore``, or a one-line ``ImportError`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as err:
        raise ImportError(
            "mooncake:// stores need Mooncake: pip install mooncake-transfer-engine "
            f"(or mooncake-transfer-engine-non-cuda) ({err})"
        ) from None
    return MooncakeDistributedStore


def address_of(view: memoryview) -> int | None:
    """Address of a writable buffer's first byte; None for a read-only one. Holds no export
    (a held export would keep the caller's shared memory from closing)."""
    if view.readonly:
        return None
    cell = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(cell)
    finally:
        del cell


class ObjectPath:
    """A block's place in the store, shaped like the file store's ``Path`` for the callers
    that remove a corrupt block (``worker.read_or_miss``: ``store.path(key).unlink``)."""

    def __init__(self, store: MooncakeBlockStore, key: str) -> None:
        self.store = store
        self.key = key
        self.name = key

    def unlink(self, missing_ok: bool = False) -> None:
        if not self.store.remove(self.key) and not missing_ok:
            raise FileNotFoundError(errno.ENOENT, f"block {self.key} is not in the store")

    def is_file(self) -> bool:
        return self.store.has(self.key)

    def __str__(self) -> str:
        return f"{self.store.url}/{self.key}"


class MooncakeBlockStore:
    """Full Blocks in a Mooncake Store, with ``KVStore``'s interface and guarantees.

    ``client``: a set-up ``MooncakeDistributedStore`` (``connect`` makes one). Every call is
    bounded by ``timeout_s``: one that takes longer raises ``MooncakeError`` (``ETIMEDOUT``)
    and its thread is left to finish; a zero-copy read may then still land in ``out`` later."""

    batched = True  # a batch costs the master's round trips once, not once a block

    def __init__(
        self,
        client: Any,
        layout: BlockLayout,
        namespace: str = "",
        url: str = "mooncake://",
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.layout = layout
        self.fingerprint = fingerprint(namespace)
        self.url = url
        self.timeout_s = timeout_s
        self.object_bytes = OBJECT_HEADER_BYTES + layout.full_block_bytes
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="mooncake")
        self._regions: dict[int, int] = {}  # registered start address -> end address
        self._headers = mmap.mmap(-1, HEADER_SLOTS * OBJECT_HEADER_BYTES)  # header scratch
        self._headers_at = address_of(memoryview(self._headers)) or 0
        self._headers_registered = False  # registered at the first zero-copy transfer
        self._free_slots = list(range(HEADER_SLOTS))
        self._slots_freed = threading.Condition()

    @classmethod
    def connect(
        cls,
        master: str,
        layout: BlockLayout,
        namespace: str = "",
        local_hostname: str = "127.0.0.1",
        local_buffer_bytes: int = LOCAL_BUFFER_BYTES,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> MooncakeBlockStore:
        """A pure client (contributes no memory) of the master at ``HOST:PORT``; its transfer
        engine binds and advertises ``local_hostname`` (a node's SNIC address)."""
        client_class = load_client_class()
        host, _, port = master.rpartition(":")
        try:  # setup() would retry an unreachable master for 90 s
            socket.create_connection((host, int(port)), timeout=2.0).close()
        except OSError as err:
            raise ConnectionError(f"mooncake master {master} is not reachable: {err}") from None
        client = client_class()
        store = cls(client, layout, namespace, f"mooncake://{master}", timeout_s)
        args = (local_hostname, "P2PHANDSHAKE", 0, local_buffer_bytes, "tcp", "", master)
        try:
            rc = store._call("setup", CONNECT_TIMEOUT_S, client.setup, *args)
        except MooncakeError:
            store._calls.shutdown(wait=False)
            raise
        if rc != OK:
            store._calls.shutdown(wait=False)
            raise MooncakeError(f"setup with master {master}", rc)
        return store

    # -- plumbing ------------------------------------------------------------------------

    def _call(self, what: str, timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise MooncakeError(what, 0, errno.ETIMEDOUT) from None

    def _do(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        return self._call(what, self.timeout_s, fn, *args)

    def register(self, memory: memoryview) -> None:
        """Register ``memory`` (e.g. the node buffer's shared memory) for zero-copy transfers
        of the blocks that lie inside it. Keep it mapped until ``close``."""
        start = address_of(memory)
        if start is None:
            raise ValueError("memory is read-only: only writable memory can be registered")
        rc = self._do("register_buffer", self.client.register_buffer, start, len(memory))
        if rc != OK:
            raise MooncakeError("register_buffer", rc)
        self._regions[start] = start + len(memory)

    def _registered(self, view: memoryview) -> int | None:
        """``view``'s address if it lies inside registered memory, else None."""
        start = address_of(view)
        if start is None:
            return None
        end = start + len(view)
        for lo, hi in self._regions.items():
            if lo <= start and end <= hi:
                return start
        return None

    def _header_slots(self, n: int) -> list[int]:
        """Take ``n`` header slots (waits for slots other threads hold)."""
        with self._slots_freed:
            if not self._headers_registered:
                register = self.client.register_buffer
                rc = self._do("register_buffer", register, self._headers_at, len(self._headers))
                if rc != OK:
                    raise MooncakeError("register_buffer", rc)
                self._headers_registered = True
            self._slots_freed.wait_for(lambda: len(self._free_slots) >= n)
            taken, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return taken

    def _free_header_slots(self, slots: list[int]) -> None:
        with self._slots_freed:
            self._free_slots.extend(slots)
            self._slots_freed.notify_all()

    def _header(self, crc: int) -> bytes:
        return block_header(self.layout, crc, self.fingerprint, OBJECT_HEADER_BYTES)

    def _verify(self, key: str, head: bytes | memoryview, payload: memoryview) -> None:
        """Raise unless ``head`` ‖ ``payload`` is a sound block of this namespace and layout.
        The fingerprint is checked first: another tenant's block is never called corrupt
        (a corrupt block gets removed)."""
        lay = self.layout
        if len(head) < FILE_HEADER.size:
            raise BlockCorrupt(f"block {key}: truncated header")
        magic, version, layers, tokens, row, size, crc, fp = FILE_HEADER.unpack_from(head)
        if magic == MAGIC and fp != self.fingerprint:
            raise BlockForeign(f"block {key}: written under another namespace")
        if (magic, version, layers, tokens, row) != (MAGIC, VERSION, *_dims(lay)):
            raise BlockCorrupt(f"block {key}: header {(magic, version, layers, tokens, row)}")
        if size != lay.full_block_bytes or len(payload) != size:
            raise BlockCorrupt(f"block {key}: {len(payload)} payload bytes, expected {size}")
        if zlib.crc32(payload) != crc:
            raise BlockCorrupt(f"block {key}: checksum mismatch")

    # -- the KVStore interface -----------------------------------------------------------

    def path(self, key: str) -> ObjectPath:
        return ObjectPath(self, key)

    def has(self, key: str) -> bool:
        """Whether the block is stored (a put that completed); False if the master cannot say."""
        try:
            return self._do("is_exist", self.client.is_exist, key) == 1
        except MooncakeError:
            return False

    def lookup(self, keys: Sequence[str]) -> int:
        """Hit tokens: leading stored blocks of the chain (one batched query), in tokens; 0
        when the master cannot answer (a miss: the tokens are recomputed)."""
        if not keys:
            return 0
        try:
            found = self._do("batch_is_exist", self.client.batch_is_exist, list(keys))
        except MooncakeError:
            return 0
        hits = 0
        for flag in found:
            if flag != 1:
                break
            hits += 1
        return hits * self.layout.block_tokens

    def write_block(self, key: str, payload: memoryview | bytes) -> bool:
        """Store one Full Block (one all-or-nothing put); False if it is already stored
        (content-addressed). ``MooncakeError`` (an ``OSError``) if the put fails."""
        lay = self.layout
        if len(payload) != lay.full_block_bytes:
            raise ValueError(
                f"payload of {len(payload)} bytes is invalid: must be {lay.full_block_bytes}"
            )
        if self.has(key):
            return False
        view = memoryview(payload).cast("B")
        head = self._header(zlib.crc32(view))
        at = self._registered(view)
        if at is None:
            rc = self._do("put", self.client.put_parts, key, head, view)
        else:
            rc = self._put_from(key, head, at)
        if rc == ALREADY_EXISTS:
            return False
        if rc != OK:
            err = errno.ENOSPC if rc == NO_SPACE else errno.EIO
            raise MooncakeError(f"put of block {key}", rc, err)
        return True

    def write_blocks(
        self, keys: Sequence[str], payloads: Sequence[memoryview]
    ) -> list[bool | OSError]:
        """Store several Full Blocks: one existence query, then one batched put of those
        in registered memory (each object still all-or-nothing); per block True (stored),
        False (already stored) or the ``MooncakeError`` its put failed with. Over a network
        a batch costs the master's round trips once, not once a block."""
        size = self.layout.full_block_bytes
        views = [memoryview(p).cast("B") for p in payloads]
        for v in views:
            if len(v) != size:
                raise ValueError(f"payload of {len(v)} bytes is invalid: must be {size}")
        out: list[bool | OSError] = [False] * len(keys)
        try:
            found = self._do("batch_is_exist", self.client.batch_is_exist, list(keys))
        except MooncakeError as err:
            return [err] * len(keys)
        todo = [i for i, flag in enumerate(found) if flag != 1]
        fast = [(i, at) for i in todo if (at := self._registered(views[i])) is not None]
        for i in sorted(set(todo) - {i for i, _ in fast}):  # unregistered: one put each
            try:
                out[i] = self.write_block(keys[i], views[i])
            except MooncakeError as err:
                out[i] = err
        for lo in range(0, len(fast), MAX_BATCH):
            chunk = fast[lo : lo + MAX_BATCH]
            slots = self._header_slots(len(chunk))
            try:
                ptrs, sizes = [], []
                for (i, at), slot in zip(chunk, slots, strict=True):
                    offset = slot * OBJECT_HEADER_BYTES
                    self._headers[offset : offset + OBJECT_HEADER_BYTES] = self._header(
                        zlib.crc32(views[i])
                    )
                    ptrs.append([self._headers_at + offset, at])
                    sizes.append([OBJECT_HEADER_BYTES, size])
                put = self.client.batch_put_from_multi_buffers
                try:
                    rcs = self._do("put", put, [keys[i] for i, _ in chunk], ptrs, sizes)
                except MooncakeError as err:
                    rcs = [err] * len(chunk)
            finally:
                self._free_header_slots(slots)
            for (i, _), rc in zip(chunk, rcs, strict=True):
                if isinstance(rc, MooncakeError):
                    out[i] = rc
                elif rc == OK:
                    out[i] = True
                elif rc == ALREADY_EXISTS:
                    out[i] = False
                else:
                    code = errno.ENOSPC if rc == NO_SPACE else errno.EIO
                    out[i] = MooncakeError(f"put of block {keys[i]}", rc, code)
        return out

    def _put_from(self, key: str, head: bytes, at: int) -> int:
        (slot,) = self._header_slots(1)
        try:
            offset = slot * OBJECT_HEADER_BYTES
            self._headers[offset : offset + OBJECT_HEADER_BYTES] = head
            ptrs = [[self._headers_at + offset, at]]
            sizes = [[OBJECT_HEADER_BYTES, self.layout.full_block_bytes]]
            put = self.client.batch_put_from_multi_buffers
            return self._do("put", put, [key], ptrs, sizes)[0]
        finally:
            self._free_header_slots([slot])

    def read_block(self, key: str, out: memoryview) -> None:
        """Read and verify one Full Block into ``out`` (exactly ``full_block_bytes``):
        ``BlockMissing`` / ``BlockCorrupt`` / ``BlockForeign`` / ``BlockUnreadable`` (the
        store cannot be reached or timed out)."""
        err = self.read_blocks([key], [out])[0]
        if err is not None:
            raise err

    def read_blocks(
        self, keys: Sequence[str], outs: Sequence[memoryview]
    ) -> list[KVStoreError | None]:
        """Read several blocks (batched calls for those in registered memory); per block None
        if it was read and verified, else the error ``read_block`` would raise."""
        size = self.layout.full_block_bytes
        for out in outs:
            if len(out) != size:
                raise ValueError(f"out of {len(out)} bytes is invalid: must be {size}")
        views = [memoryview(out).cast("B") for out in outs]
        results: list[KVStoreError | None] = [None] * len(keys)
        fast = [(i, at) for i, v in enumerate(views) if (at := self._registered(v)) is not None]
        slow = sorted(set(range(len(keys))) - {i for i, _ in fast})
        for lo in range(0, len(fast), MAX_BATCH):
            chunk = fast[lo : lo + MAX_BATCH]
            retry = self._get_into([keys[i] for i, _ in chunk], [at for _, at in chunk], chunk)
            for i, err in retry.items():
                results[i] = err
            slow.extend(i for i, err in retry.items() if err is None)
        for i in sorted(slow):
            results[i] = self._read_bytes(keys[i], views[i])
        return results

    def _get_into(
        self, keys: list[str], ats: list[int], chunk: list[tuple[int, int]]
    ) -> dict[int, KVStoreError | None]:
        """Zero-copy reads of ``keys``: the errors of those that failed by index; None marks a
        block to read again through the bytes path (its object has another size: verified
        there)."""
        size = self.layout.full_block_bytes
        slots = self._header_slots(len(keys))
        try:
            heads = [self._headers_at + s * OBJECT_HEADER_BYTES for s in slots]
            ptrs = [[h, at] for h, at in zip(heads, ats, strict=True)]
            sizes = [[OBJECT_HEADER_BYTES, size]] * len(keys)
            get = self.client.batch_get_into_multi_buffers
            try:
                rcs = self._do("get", get, keys, ptrs, sizes)
            except MooncakeError as err:
                return {i: BlockUnreadable(f"block {keys[0]}..: {err}") for i, _ in chunk}
            failed: dict[int, KVStoreError | None] = {}
            for (i, at), key, slot, rc in zip(chunk, keys, slots, rcs, strict=True):
                if rc == NOT_FOUND:
                    failed[i] = BlockMissing(f"block {key} is not in {self.url}")
                elif rc != self.object_bytes:
                    failed[i] = None
                else:
                    offset = slot * OBJECT_HEADER_BYTES
                    head = self._headers[offset : offset + OBJECT_HEADER_BYTES]
                    out = (ctypes.c_char * size).from_address(at)
                    try:
                        self._verify(key, head, memoryview(out).cast("B"))
                    except KVStoreError as err:
                        failed[i] = err
            return failed
        finally:
            self._free_header_slots(slots)

    def _read_bytes(self, key: str, out: memoryview) -> KVStoreError | None:
        """The copying path (unregistered memory, or an object of an unexpected size)."""
        try:
            data = self._do("get", self.client.get, key)
            if not data:  # get() answers b"" for a missing object and for a failed one
                exists = self._do("is_exist", self.client.is_exist, key)
                if exists == 0:
                    return BlockMissing(f"block {key} is not in {self.url}")
                return BlockUnreadable(f"block {key}: get failed (is_exist {exists})")
        except MooncakeError as err:
            return BlockUnreadable(f"block {key}: {err}")
        view = memoryview(data)
        try:
            self._verify(key, view[:OBJECT_HEADER_BYTES], view[OBJECT_HEADER_BYTES:])
        except KVStoreError as err:
            return err
        out[:] = view[OBJECT_HEADER_BYTES:]
        return None

    def remove(self, key: str) -> bool:
        """Remove a block (a corrupt one, so that the recomputed block is stored again);
        whether one was there. Forced: a recent ``get`` leases the object (-706) otherwise."""
        rc = self._do("remove", self.client.remove, key, True)
        if rc == NOT_FOUND:
            return False
        if rc != OK:
            raise MooncakeError(f"remove of block {key}", rc)
        return True

    def quarantine(self, path: ObjectPath) -> bool:
        """``KVStore.quarantine``'s counterpart: nothing stands in a key's way here, so
        moving aside is removing."""
        try:
            return self.remove(path.key)
        except MooncakeError:
            return False

    def close(self) -> None:
        """Unregister memory and close the client (a call still stuck is left to finish)."""
        for start in sorted(self._regions):
            self._try("unregister_buffer", self.client.unregister_buffer, start)
        if self._headers_registered:
            self._try("unregister_buffer", self.client.unregister_buffer, self._headers_at)
            self._headers_registered = False
        self._regions.clear()
        self._try("close", self.client.close)
        self._calls.shutdown(wait=False)

    def _try(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(MooncakeError):  # closing: a gone master is no reason to fail
            self._do(what, fn, *args)

    def __enter__(self) -> MooncakeBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dims(layout: BlockLayout) -> tuple[int, int, int]:
    return (layout.num_layers, layout.block_tokens, layout.row_bytes)
