"""Max-min fair rate allocation by progressive filling (design §6): a pure helper of the fluid
network, over plain lists indexed by flow slot and resource id."""

from __future__ import annotations

import heapq
import math


def fill_max_min(
    flows: list[int],
    capped: list[tuple[float, int, int]],
    members: list[dict[int, int]] | dict[int, dict[int, None]],
    res: list[int],
    paths: list[tuple[int, ...]],
    out: list[float],
    avail: list[float],
    cnt: list[int],
    order: list[int] | None = None,
) -> None:
    """Max-min fair rates by progressive filling, written to ``out[slot]``.

    ``flows`` are slots of one class; ``capped`` lists ``(rate cap, flow id, slot)`` for
    those of them with a finite cap, sorted; ``members[r]`` maps slot -> multiplicity for that class
    (or holds, for each ``r`` in ``res``, at least the slots of ``flows`` that cross it: only
    its keys are read, the unfrozen ones, and the order within one level changes no bit);
    ``res`` holds every resource those flows use; ``avail[r]`` is the capacity left for them
    and is decremented by what they take; ``cnt[r]`` holds, for each ``r`` in ``res``, the
    number of (flow, crossing) pairs of this class through ``r`` (the sum of ``members[r]``'s
    multiplicities) and is used as scratch. All unfrozen flows share one rising level; a
    resource saturates at level ``avail / unfrozen count`` (never decreasing as flows freeze
    below it), so a heap of those levels, refreshed lazily when an entry reaches the top,
    yields bottlenecks in order. Cost: O(I) for I (flow, resource) incidences plus the heap
    refreshes. A rate cap freezes its flow at the cap (ties: by flow id). ``order``, when
    given, receives the slots in the order they freeze (the order of the subtractions from
    each resource's ``avail``; ``IncrementalFill`` keeps it per resource).
    """
    if not flows:
        return
    if order is None:
        order = []
    freeze = order.append
    heap: list[tuple[float, int]] = []
    for r in res:
        n = cnt[r]
        if n > 0:
            a = avail[r]
            heap.append(((a if a > 0.0 else 0.0) / n, r))
    heapq.heapify(heap)
    for s in flows:
        out[s] = -1.0  # unfrozen
    num_left = len(flows)
    ci, nc = 0, len(capped)
    cap_level = math.inf
    pop, replace = heapq.heappop, heapq.heapreplace
    while num_left:
        if ci < nc:
            # every key is at most its resource's level, so a cap at most the lowest key is
            # at most the lowest level: such capped flows freeze first, in order, without
            # refreshing the heap (which they do not touch)
            top = heap[0][0] if heap else math.inf
            while ci < nc:
                level, _, s = capped[ci]
                if out[s] >= 0.0:  # frozen already (at a bottleneck)
                    ci += 1
                    continue
                if level > top:
                    break
                ci += 1
                out[s] = level
                freeze(s)
                for r2 in paths[s]:
                    avail[r2] -= level
                    cnt[r2] -= 1
                num_left -= 1
            if not num_left:
                break
        level, r = math.inf, -1
        while heap:  # lazy increase-key: refresh the top until it is current
            key, r = heap[0]
            n = cnt[r]
            if n <= 0:
                pop(heap)
                continue
            a = avail[r]
            level = (a if a > 0.0 else 0.0) / n
            if level > key:
                replace(heap, (level, r))
                continue
            break
        if nc:  # the next capped flow (frozen ones skipped above)
            cap_level = capped[ci][0] if ci < nc else math.inf
        if heap and level < cap_level:
            pop(heap)
            m = members[r]
            batch = [s for s in m if out[s] < 0.0] if len(m) > 1 else list(m)
        elif ci < nc:
            level = cap_level
            batch = [capped[ci][2]]
            ci += 1
        else:  # unreachable: every flow crosses at least one resource
            break
        for s in batch:
            out[s] = level
            freeze(s)
            for r2 in paths[s]:
                avail[r2] -= level
                cnt[r2] -= 1
        num_left -= len(batch)
    for s in flows:  # only if the loop broke early, which it cannot
        if out[s] < 0.0:
            out[s] = 0.0
