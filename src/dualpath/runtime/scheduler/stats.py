"""What the scheduler publishes for a server's stats thread: one frozen snapshot, built on the
scheduler's thread and swapped in whole, so the other thread never reads live state."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.ledger import Topology
from dualpath.ledger.counters import RunCounters
from dualpath.runtime.gputime import GpuUse

STATS_PUBLISH_S = 0.1  # how often the run loop publishes a snapshot (when asked to)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Totals since start and queue lengths, as of ``now_s`` (the scheduler's clock)."""

    now_s: float = 0.0
    num_waiting: int = 0  # not yet assigned by the policy, or waiting for buffer slots
    requeued: int = 0
    cancelled: int = 0
    persist_failed: int = 0  # block writes dropped (e.g. a full disk)
    kv_bytes_by_path: dict[str, int] = field(default_factory=dict)  # by ``types.KVPath``
    queue_lengths: dict[str, int] = field(default_factory=dict)
    # per engine, emulated GPU time only: (passes or decode steps, those that overran)
    gpu_passes: dict[str, tuple[int, int]] = field(default_factory=dict)


def snapshot(
    now_s: float,
    counters: RunCounters,
    read_q: list[int],
    pe_queue: dict[int, list[int]],
    policy_waiting: int,
    alloc_waiting: int,
    cancelled: int,
    gpu: dict[int, GpuUse],
    topo: Topology,
) -> SchedulerStats:
    queues = {f"read_node{n}_tokens": q for n, q in enumerate(read_q)}
    for e, q in sorted(pe_queue.items()):
        queues[f"prefill_pe{e}"] = len(q)
    queues["policy_waiting"] = policy_waiting
    queues["buffer_alloc_waiting"] = alloc_waiting
    return SchedulerStats(
        now_s=now_s,
        num_waiting=policy_waiting + alloc_waiting,
        requeued=counters.requeued,
        cancelled=cancelled,
        persist_failed=counters.persist_failed,
        kv_bytes_by_path=counters.whole_bytes(),
        queue_lengths=queues,
        gpu_passes={topo.engine_name(e): (u.passes, u.overran) for e, u in sorted(gpu.items())},
    )


class Publisher:
    """Publishes a snapshot every ``every_s`` once asked to (``start``); ``stats`` is the
    last one (another thread may read it: it is replaced whole)."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self.every_s: float | None = None
        self._at_s = float("-inf")

    def start(self, every_s: float) -> None:
        self.every_s = every_s

    def due(self, now_s: float) -> bool:
        return self.every_s is not None and now_s - self._at_s >= self.every_s

    def publish(self, stats: SchedulerStats) -> None:
        self._at_s = stats.now_s
        self.stats = stats
