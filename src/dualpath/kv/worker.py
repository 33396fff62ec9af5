"""The storage-worker core that every shell's node process shares: a block read or a miss, a
block write with bounded retries, the SNIC's two pacers, and the write-fault hook.

The runtime's storage worker (``runtime/storage.py``) and the vLLM side-car
(``integrations/vllm/sidecar.py``) are thin processes around these: each owns its node's
buffer and queues, and both read, persist and pace through the functions here.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

from dualpath.kv.pacer import Pacer
from dualpath.kv.store import HEADER_BYTES, BlockCorrupt, BlockStore, KVStoreError, write_all

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
    removes it). The error comes back without its traceback: the traceback's frames hold
    ``payload``, a view of the node buffer, whose shared memory could then not be closed."""
    err: OSError | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 4 ** (attempt - 1))
        try:
            store.write_block(key, payload)
            return None
        except OSError as e:
            err = e.with_traceback(None)
            if e.errno in NO_RETRY_ERRNOS:
                break
    return err


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
