"""Machine references timed in the same process as a benchmark, so that its figures can be
compared across machines (speeds are quoted beside them, never alone)."""

from __future__ import annotations

import heapq
import time
from typing import Any


def bare_heapq_s(events: int) -> float:
    """CPU seconds of a bare heapq event loop of ``events`` events (push one, pop one)."""
    heap: list[tuple[float, int, Any]] = [(0.0, 0, None)]
    cpu0 = time.process_time()
    push, pop = heapq.heappush, heapq.heappop
    for i in range(events):
        t, _, _ = pop(heap)
        push(heap, (t + 1.0, i, None))
    return time.process_time() - cpu0
