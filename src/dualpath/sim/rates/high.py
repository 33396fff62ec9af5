"""The HIGH (traffic manager) refill of the fluid network's rates (design §6): HIGH's rates
depend only on HIGH flows and on which resources carry both classes, so HIGH is refilled
apart, and only where one of those changed.

``HighShares`` owns, per resource, what the last HIGH filling left and whether both classes
were there: what LOW fills on. It writes the new rates of the HIGH flows it re-rates into
the solver's ``new`` and no resource's settled rate (the LOW fill that follows does).
"""

from __future__ import annotations

from dualpath.sim.flowtable import FlowTable
from dualpath.sim.maxmin import fill_max_min
from dualpath.sim.rates.capped import CappedKeys


class HighShares:
    """What HIGH leaves on each resource, kept across settles and refilled where it can
    change.

    Per resource: ``left``, what the last HIGH filling left of HIGH's share (the capacity,
    or ``1 - low_floor`` of it where both classes are), and ``shared``, whether both classes
    were there. LOW fills on ``left`` plus the floor HIGH could not take; the whole-component
    fill, which fills both classes, writes both lists too. Its own state besides: walk marks
    and scratch for filling.
    """

    def __init__(self, table: FlowTable, *, low_floor: float, new: list[float]) -> None:
        self.t = table
        self._floor = low_floor
        self._new = new  # per flow slot: the new rates (the solver's)
        self.left: list[float] = []
        self.shared: list[bool] = []
        self._avail: list[float] = []  # scratch for filling
        self._cnt: list[int] = []
        self._rmark: list[int] = []  # walk marks, per resource and per flow slot
        self._f_mark: list[int] = []
        self._epoch = 0
        self._capped = CappedKeys(table)

    def add_resource(self, capacity: float) -> None:
        self.left.append(capacity)
        self.shared.append(False)
        self._avail.append(0.0)
        self._cnt.append(0)
        self._rmark.append(-1)

    def add_slot(self) -> None:
        self._f_mark.append(-1)
        self._capped.add_slot()

    def refill(
        self, dirty: list[int], forced: dict[int, None], dirty_high: dict[int, None]
    ) -> list[int]:
        """Refill HIGH over the HIGH flows connected to the dirty resources where a HIGH flow
        started or ended (``dirty_high``) or ``shared`` flipped (HIGH rates depend on nothing
        else). Resources where what HIGH leaves changed are added to ``dirty`` and
        ``forced`` (LOW refills there). Returns the HIGH flows re-rated (rates in ``new``)."""
        t0, t1 = self.t.tot
        shared = self.shared
        start = [r for r in dirty if r in dirty_high or bool(t0[r] and t1[r]) is not shared[r]]
        if not start:
            return []
        self._epoch += 1
        epoch = self._epoch
        rmark, fmark, paths, m0 = self._rmark, self._f_mark, self.t.f_path, self.t.members[0]
        for r in start:
            rmark[r] = epoch
        res = start
        flows: list[int] = []
        for r in res:  # grows while iterated
            for s in m0[r]:
                if fmark[s] != epoch:
                    fmark[s] = epoch
                    flows.append(s)
                    for r2 in paths[s]:
                        if rmark[r2] != epoch:
                            rmark[r2] = epoch
                            res.append(r2)
        cap, avail, cnt, left = self.t.cap, self._avail, self._cnt, self.left
        high_share = 1.0 - self._floor
        for r in res:
            avail[r] = cap[r] * high_share if t0[r] and t1[r] else cap[r]
            cnt[r] = t0[r]
        fill_max_min(flows, self._capped.among(flows), m0, res, paths, self._new, avail, cnt)
        in_dirty = set(dirty)
        for r in res:
            both = bool(t0[r] and t1[r])
            a = avail[r]
            if a != left[r] or both is not shared[r]:
                left[r] = a
                shared[r] = both
                forced[r] = None
                if r not in in_dirty:
                    dirty.append(r)
        return flows
