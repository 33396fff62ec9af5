"""What a run moved and did, for its result: KV bytes per load path (``types.KVPath``), the
PE passes' figures, requeues, buffer stalls and each node's storage-read windows.

Pure: a shell reports each amount as it happens; ``RunResult`` and the server's stats read
them here and nowhere else (the view's counters of SPEC §13.4 are the ``Ledger``'s).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dualpath.types import KVPath

# the paths the runtime tells apart (a layer load from either buffer is one path), in the
# order results list them
RUNTIME_PATHS = (
    KVPath.STORAGE_TO_PE_BUFFER,
    KVPath.STORAGE_TO_DE_BUFFER,
    KVPath.BUFFER_TO_PE_HBM,
    KVPath.PE_HBM_TO_DE_BUFFER,
    KVPath.DE_BUFFER_TO_DE_HBM,
    KVPath.DE_TO_STORAGE,
)


def _runtime_paths() -> dict[str, int]:
    return dict.fromkeys(RUNTIME_PATHS, 0)


@dataclass(slots=True)
class RunCounters:
    """Totals since the run started. ``max_pass_tokens``: most cached + new tokens resident
    in one pass; ``pass_busy_s``: Σ pass durations as the PEs measured them."""

    bytes_by_path: dict[str, int] = field(default_factory=_runtime_paths)  # by ``KVPath``
    persist_failed: int = 0  # block writes dropped after failing (e.g. ENOSPC): not cached
    requeued: int = 0  # turns re-queued after a process died (or reads re-issued)
    alloc_stalls: int = 0  # times a turn found its buffer full and waited
    passes: int = 0  # PE forward passes
    pass_chunks: int = 0  # chunks over all passes (mean batch = pass_chunks / passes)
    chunked: int = 0  # chunks that were not a turn's last
    max_pass_tokens: int = 0
    pass_new_tokens: int = 0  # tokens computed by all passes
    pass_busy_s: float = 0.0
    read_windows: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    def moved(self, path: KVPath, num_bytes: int) -> None:
        """``num_bytes`` of KV went over ``path``."""
        self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + num_bytes

    def pass_started(self, chunks: Iterable[tuple[int, int]]) -> None:
        """A PE pass over ``chunks`` (cached, new tokens each) started."""
        sizes = [cached + new for cached, new in chunks]
        self.passes += 1
        self.pass_chunks += len(sizes)
        self.max_pass_tokens = max(self.max_pass_tokens, sum(sizes))

    def pass_done(self, new_tokens: int, start_s: float, done_s: float) -> None:
        self.pass_new_tokens += new_tokens
        self.pass_busy_s += done_s - start_s

    def read_window(self, node: int, start_s: float, done_s: float) -> None:
        """A storage read on ``node`` ran from ``start_s`` to ``done_s``."""
        self.read_windows.setdefault(node, []).append((start_s, done_s))

    def read_bytes(self) -> int:
        """Bytes read from storage on both read paths."""
        paths = self.bytes_by_path
        return paths.get(KVPath.STORAGE_TO_PE_BUFFER, 0) + paths.get(KVPath.STORAGE_TO_DE_BUFFER, 0)
