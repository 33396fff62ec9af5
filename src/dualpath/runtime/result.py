"""One runtime run's result, built from the core's counters (``ledger.counters.RunCounters``:
KV bytes per load path, keyed by ``types.KVPath``, as the server's stats report them too).

Reads the run through the ``RunSource`` protocol, never by importing the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the result module stays importable without the runtime extra
    from dualpath.ledger import Topology
    from dualpath.ledger.counters import RunCounters
    from dualpath.metrics import TurnRecord
    from dualpath.runtime.env import ProcEnv
    from dualpath.runtime.gputime import GpuUse


class AgentProgress(Protocol):
    @property
    def generated(self) -> list[tuple[int, ...]]: ...


class RunSource(Protocol):
    """The scheduler as a run result reads it."""

    @property
    def counters(self) -> RunCounters: ...
    @property
    def env(self) -> ProcEnv: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def records(self) -> Sequence[TurnRecord]: ...
    @property
    def agents(self) -> Mapping[int, AgentProgress]: ...
    @property
    def gpu(self) -> Mapping[int, GpuUse]: ...  # per engine, emulated GPU time only


def kv_bytes_by_path(c: RunCounters) -> dict[str, int]:
    """Bytes moved per KV path so far (the runtime counts layer loads from either buffer as
    one: ``BUFFER_TO_PE_HBM``)."""
    return c.whole_bytes()


def union_s(windows: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` windows, seconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(windows):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass(frozen=True, slots=True)
class RunResult:
    """Records (for ``dualpath.metrics.summarize``), outputs, bytes per path, SNIC use."""

    records: tuple[TurnRecord, ...]
    outputs: dict[int, tuple[tuple[int, ...], ...]]  # agent → generated tokens per turn
    bytes_by_path: dict[str, int]  # keyed by ``types.KVPath``
    snic_busy_utilisation: float  # bytes read / (SNIC rate × time each SNIC had reads); NaN: n/a
    snic_aggregate_utilisation: float  # bytes read / (all SNICs' rate × time any read ran)
    requeued: int
    alloc_stalls: int
    wall_s: float
    forward_passes: int = 0  # PE forward passes
    forward_chunks: int = 0  # request chunks over all passes (mean batch = chunks / passes)
    chunked: int = 0  # chunks that were not their request's last (chunked prefill)
    max_pass_tokens: int = 0  # most cached + new tokens one pass held
    pass_new_tokens: int = 0  # tokens computed by all PE passes
    pass_busy_s: float = 0.0  # Σ PE pass durations (engine-measured)
    # per engine name, with ``gpu_time="emulated"``: passes / steps, overruns, Σ times
    gpu_use: dict[str, GpuUse] = field(default_factory=dict)

    @property
    def mean_batch(self) -> float:
        return self.forward_chunks / self.forward_passes if self.forward_passes else 0.0

    @classmethod
    def build(cls, sched: RunSource, start_s: float, end_s: float) -> RunResult:
        c = sched.counters
        rate = sched.env.config.hardware.snic_total_bytes_per_s
        read = c.read_bytes()
        busy = sum(union_s(w) for w in c.read_windows.values())
        span = union_s([x for w in c.read_windows.values() for x in w])
        nodes = sched.topo.num_nodes
        paced = sched.env.options.paced_kv  # the Oracle's reads take no SNIC time: no figure
        nan = float("nan")
        return cls(
            records=tuple(sorted(sched.records, key=lambda r: r.request_id)),
            outputs={a: tuple(s.generated) for a, s in sorted(sched.agents.items())},
            bytes_by_path=kv_bytes_by_path(c),
            snic_busy_utilisation=read / (rate * busy) if busy > 0 and paced else nan,
            snic_aggregate_utilisation=read / (rate * nodes * span) if span > 0 and paced else nan,
            requeued=c.requeued,
            alloc_stalls=c.alloc_stalls,
            wall_s=end_s - start_s,
            forward_passes=c.passes,
            forward_chunks=c.pass_chunks,
            chunked=c.chunked,
            max_pass_tokens=c.max_pass_tokens,
            pass_new_tokens=c.pass_new_tokens,
            pass_busy_s=c.pass_busy_s,
            gpu_use={sched.topo.engine_name(e): u for e, u in sorted(sched.gpu.items())},
        )
