"""What a run moved and did, for its result: KV bytes per load path (``types.KVPath``), the
PE passes' figures, requeues, buffer stalls and each node's storage-read windows.

Pure: a shell reports each amount as it happens; the runtime's ``RunResult``, the server's
stats and the simulator's ``SimResult.path_bytes`` read bytes per path here and nowhere else
(the view's counters of design §13.4 are the ``Ledger``'s).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


# the paths the vLLM shell tells apart (its router and its connectors' workers): a layer
# load by its source buffer; the side-cars count what they write to storage themselves
VLLM_PATHS = (
    KVPath.STORAGE_TO_PE_BUFFER,
    KVPath.STORAGE_TO_DE_BUFFER,
    KVPath.PE_BUFFER_TO_PE_HBM,
    KVPath.DE_BUFFER_TO_PE_HBM,
    KVPath.PE_HBM_TO_DE_BUFFER,
    KVPath.DE_BUFFER_TO_DE_HBM,
)


# the paths the simulator tells apart: every hop, a layer load by its source buffer (its DEs
# persist every block, as the paper's: no PE writes)
SIM_PATHS = tuple(p for p in KVPath if p not in (KVPath.BUFFER_TO_PE_HBM, KVPath.PE_TO_STORAGE))


def _runtime_paths() -> dict[str, float]:
    return dict.fromkeys(RUNTIME_PATHS, 0.0)


@dataclass(slots=True)
class RunCounters:
    """Totals since the run started. ``bytes_by_path``: by ``KVPath``, the runtime's paths
    (``RUNTIME_PATHS``: whole blocks, ``whole_bytes``) unless built ``over`` others (the
    simulator's ``SIM_PATHS``: fluid bytes). ``max_pass_tokens``: most cached + new tokens resident in one
    pass; ``pass_busy_s``: Σ pass durations as the PEs measured them."""

    bytes_by_path: dict[str, float] = field(default_factory=_runtime_paths)
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

    @classmethod
    def over(cls, paths: Sequence[KVPath]) -> RunCounters:
        """Counters whose bytes per path list ``paths``, in that order, from 0.0 bytes."""
        return cls(bytes_by_path=dict.fromkeys(paths, 0.0))

    def moved(self, path: KVPath, num_bytes: float) -> None:
        """``num_bytes`` of KV went over ``path``."""
        self.bytes_by_path[path] = self.bytes_by_path.get(path, 0) + num_bytes

    def whole_bytes(self) -> dict[str, int]:
        """Bytes per path as whole bytes (the runtime's: it moves whole blocks)."""
        return {path: round(n) for path, n in self.bytes_by_path.items()}

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

    def read_bytes(self) -> float:
        """Bytes read from storage on both read paths."""
        paths = self.bytes_by_path
        return paths.get(KVPath.STORAGE_TO_PE_BUFFER, 0) + paths.get(KVPath.STORAGE_TO_DE_BUFFER, 0)
