"""The order capped flows freeze in (by rate cap, then flow id) among the flows of one filling,
from the keys the table keeps (``FlowTable.f_key``, and ``capped`` sorted). Owns only its
per-slot marks; writes nothing in the table."""

from __future__ import annotations

from dualpath.sim.flowtable import FlowTable


class CappedKeys:
    """``(rate cap, flow id, slot)`` of the capped flows among a set, sorted: what
    ``fill_max_min`` takes as ``capped``."""

    def __init__(self, table: FlowTable) -> None:
        self.t = table
        self._mark: list[int] = []  # per flow slot: picked by ``among`` (its epoch)
        self._epoch = 0

    def add_slot(self) -> None:
        self._mark.append(-1)

    def among(self, flows: list[int]) -> list[tuple[float, int, int]]:
        """``(rate cap, flow id, slot)`` of the capped ones among ``flows``, sorted."""
        if not (flows and self.t.num_capped):
            return []
        every = self.t.capped
        if 4 * len(flows) < len(every):  # a few flows: sort their keys
            return sorted(filter(None, map(self.t.f_key.__getitem__, flows)))
        # most of the network (a settle over a component that spans the cluster): pick them
        # out of the sorted list of every capped flow, O(flows + capped), no sort
        self._epoch += 1
        epoch, mark = self._epoch, self._mark
        for s in flows:
            mark[s] = epoch
        return [k for k in every if mark[k[2]] == epoch]
