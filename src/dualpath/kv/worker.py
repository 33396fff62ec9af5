"""The pieces of a storage node's I/O: a block read or a miss, a block write with bounded
retries, the one write-failure policy, the SNIC's two pacers, and the write-fault hook.

``storage_node.StorageNode`` runs them on its reader and writer threads; the runtime's
storage worker (``runtime/storage.py``) and the vLLM side-car (``integrations/vllm/sidecar.py``)
are thin processes around that core.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable

from dualpath.kv.pacer import Pacer
from dualpath.kv.store import (
    HEADER_BYTES,
    BlockCorrupt,
    BlockStore,
    KVStoreError,
    bare,
    write_all,
)

# SNIC pacer quantum: 10 ms, not the CNICs' 1 ms (there HIGH must not wait long behind a LOW
# quantum; no HIGH crosses a SNIC): at 10 MB/s a Full Block's read wakes its thread 3 times,
# not 26 (the runtime's CPU per turn, benchmarks/bench_cpu.py)
SNIC_QUANTUM_S = 0.01
PERSIST_ATTEMPTS = 3  # a failed block write (I/O error) is retried ...
PERSIST_BACKOFF_S = 0.05  # ... after 0.05 s, then 0.2 s (×4 each time); then it is dropped
# a full disk (or quota), a path in the way, no permission, a read-only store: not retried
# (waiting 0.25 s changes none of them, and every block behind it in the write queue, and
# every turn waiting for its writes' acks, would wait too)
PATH_ERRNOS = frozenset(
    {errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS}
)
NO_RETRY_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, *PATH_ERRNOS})
UNWRITABLE_KEYS = 4096  # blocks a node remembers it could not write (never tried again)
FAILED_REPORT_S = 10.0  # dropped writes: one stderr line per this many seconds at most


def read_or_miss(store: BlockStore, key: str, out: memoryview) -> bool:
    """Read block ``key`` into ``out``; False if it cannot be used (missing, foreign, corrupt:
    a corrupt file is removed, so that the recomputed block gets persisted again)."""
    try:
        store.read_block(key, out)
    except BlockCorrupt:
        store.path(key).unlink(missing_ok=True)
        return False
    except KVStoreError:
        return False
    return True


def persist_with_retry(
    store: BlockStore,
    key: str,
    payload: memoryview,
    attempts: int = PERSIST_ATTEMPTS,
    backoff_s: float = PERSIST_BACKOFF_S,
) -> OSError | None:
    """Write one block, retrying OSErrors (but ENOSPC / EDQUOT) with exponential backoff; the
    last error, or None. A failed attempt leaves no temporary file (``KVStore.write_block``
    removes it). The error comes back ``bare``: no frame of it holds ``payload``."""
    err: OSError | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 4 ** (attempt - 1))
        try:
            store.write_block(key, payload)
            return None
        except OSError as e:
            err = bare(e)
            if e.errno in NO_RETRY_ERRNOS:
                break
    return err


class WriteFailures:
    """The one write-failure policy of every storage node (the runtime's storage workers,
    the vLLM side-cars): a block the store did not take after ``persist_with_retry`` is
    counted (``num_failed``) and named on stderr, the first at once and then at most one line
    per ``report_s`` (a full disk fails every write: a line each would flood the log); a block
    whose path stays in the way (``PATH_ERRNOS``) is remembered, up to ``remember`` keys, and
    dropped at once when it comes again (a full disk may have room later: tried again).
    Used by one writer thread."""

    def __init__(
        self,
        name: str,
        report_s: float = FAILED_REPORT_S,
        remember: int = UNWRITABLE_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.report_s, self.remember, self.clock = name, report_s, remember, clock
        self.num_failed = 0
        self._unwritable: dict[str, None] = {}  # insertion order: the oldest is forgotten
        self._reported_s = 0.0

    def skip(self, key: str) -> bool:
        """Whether ``key``'s write is dropped unread (its path stayed in the way before);
        counted as failed when it is."""
        if key in self._unwritable:
            self.num_failed += 1
            return True
        return False

    def failed(self, key: str, err: OSError) -> None:
        """Block ``key`` was not cached: ``err`` is why."""
        self.num_failed += 1
        if err.errno in PATH_ERRNOS:
            self._unwritable[key] = None
            if len(self._unwritable) > self.remember:
                del self._unwritable[next(iter(self._unwritable))]
        now = self.clock()
        if self.num_failed == 1 or now - self._reported_s >= self.report_s:
            self._reported_s = now
            print(
                f"dualpath: {self.name}: block {key} not cached: {err} "
                f"({self.num_failed} dropped so far)",
                file=sys.stderr,
                flush=True,
            )


class FailingWrites:
    """Fault injection (``FaultPlan.fail_writes``), a ``KVStore`` write hook: the next ``count``
    block writes (-1: all) fail with ``code`` (a full disk) after half the payload reached the
    temporary file. ``attempts`` counts the payload writes it saw (failed or not)."""

    def __init__(self, count: int, code: int = errno.ENOSPC) -> None:
        self.left = count
        self.code = code
        self.attempts = 0

    def __call__(self, fd: int, data: memoryview | bytes) -> None:
        if len(data) > HEADER_BYTES:  # the payload (a header is written whole)
            self.attempts += 1
            if self.left != 0:
                self.left -= 1
                write_all(fd, memoryview(data)[: len(data) // 2])
                raise OSError(self.code, f"{os.strerror(self.code)} (injected)")
        write_all(fd, data)


def snic_pacers(
    rate_bytes_per_s: float, name: str, clock: Callable[[], float] = time.monotonic
) -> tuple[Pacer, Pacer]:
    """The node's SNIC as two pacers, ``NAME.read`` and ``NAME.write``: full duplex, a block
    write never waits behind a read (design §13.5)."""
    read = Pacer(rate_bytes_per_s, f"{name}.read", quantum_s=SNIC_QUANTUM_S, clock=clock)
    write = Pacer(rate_bytes_per_s, f"{name}.write", quantum_s=SNIC_QUANTUM_S, clock=clock)
    return read, write
