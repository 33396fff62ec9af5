"""The incremental fill of the fluid network's rates (design §6): new max-min rates for the
flows a walk found (by ``fill_max_min``, the reference filling), the resources' settled rates,
and the check of the walk's guesses.

``IncrementalFill`` owns the scratch of filling, the kept subtractions (per resource, what
the last filling that walked through it took, in freezing order: where the next walk may
cut, ``Walk._walk_above``) and the resources whose guess failed. It writes the flows'
new rates into the solver's ``new`` and the resources' settled rates into the table; it
reads what HIGH left (``HighShares``, lists shared by reference) and the walk's
``Component``, and walks nothing itself.
"""

from __future__ import annotations

import math

from dualpath.sim.flowtable import FlowTable
from dualpath.sim.maxmin import fill_max_min
from dualpath.sim.rates.capped import CappedKeys
from dualpath.sim.rates.walk import Component, Kept

KEEP_MIN_FLOWS = 64  # a filling from the bottom keeps its subtractions from this many flows


class IncrementalFill:
    """Fills the flows of a walk's ``Component`` and settles their resources' rates.

    The filled class is LOW under the traffic manager, else the only one; it starts on each
    resource from ``base``: what HIGH left plus the floor HIGH could not take, or the
    capacity. Under the traffic manager, the whole-component fill (``low=False``: the
    reference, and the fallback) fills both classes, HIGH first, and writes what HIGH left
    too.

    Exact incremental filling: per resource, the subtractions of the last filling that
    walked through it, in freezing order: slots (``_q_slot``), running maximum of their
    rates (``_q_cmax``), what was left after each (``_q_left``), and the base it started
    from (``_q_base``); a kept flow's rate is its current one. None: not kept (an edge of a
    filling that re-rated its flows, or a flow shifted rates there: ``shift``). ``kept``
    hands the four lists to the walk.
    """

    def __init__(
        self,
        table: FlowTable,
        *,
        traffic_manager: bool,
        low_floor: float,
        local: bool,
        new: list[float],
        high_left: list[float],
        shared: list[bool],
    ) -> None:
        self.t = table
        self._tm = traffic_manager
        self._floor = low_floor
        self._local = local  # False: no subtractions kept (every walk covers whole components)
        self.new = new  # per flow slot: the new rates of the flows re-rated (the solver's)
        # per resource: what the last HIGH filling left and whether both classes were there
        # (``HighShares``'s), which is what LOW fills on
        self._high_left = high_left
        self._shared = shared
        self._capped = CappedKeys(table)  # the freezing order of the capped flows of a filling
        # per resource: scratch for filling, the kept subtractions, and a mark for those
        # walked through by the last kept filling
        self._cnt: list[int] = []
        self._scratch: list[float] = []
        self._q_slot: list[list[int] | None] = []
        self._q_cmax: list[list[float]] = []
        self._q_left: list[list[float]] = []
        self._q_base: list[float] = []
        self.kept: Kept = (self._q_slot, self._q_cmax, self._q_left, self._q_base)
        self._k_mark: list[int] = []
        self._k_stamp = 0
        self._bases: dict[int, float] = {}  # per resource walked through: the filling's base
        self.failed: list[int] = []  # resources whose guess failed in the last ``assign``

    def add_resource(self) -> None:
        self._cnt.append(0)
        self._scratch.append(0.0)
        self._q_slot.append(None)
        self._q_cmax.append([])
        self._q_left.append([])
        self._q_base.append(0.0)
        self._k_mark.append(0)

    def add_slot(self) -> None:
        self._capped.add_slot()

    def shift(self, path: tuple[int, ...], delta: float, now: float) -> None:
        """A flow at rate ``|delta|`` started (+) or ended (-) at ``now`` without a
        recomputation: account resources at their old rates, then adjust them."""
        t = self.t
        last, busy, rate, carried = t.last_s, t.busy_s, t.rate, t.carried
        t0, t1 = t.tot
        q = self._q_slot
        for r in path:
            dt = now - last[r]  # t.account, inlined: bytes and busy time at the old rate
            if dt > 0.0:
                x = rate[r]
                if x > 0.0:
                    carried[r] += x * dt
                    busy[r] += dt
                last[r] = now
            q[r] = None  # a flow its kept subtractions do not hold
            left = rate[r] + delta
            rate[r] = left if left > 0.0 and (t0[r] or t1[r]) else 0.0

    def assign(self, c: Component, low: bool) -> bool:
        """New rates of ``c.flows`` into ``new``; resource rate sums = capacity minus what is
        left (for ``edge`` resources: old sum plus the changes). Pinned flows keep their
        rate. ``low`` (traffic manager): ``flows`` are LOW, filled on what HIGH left
        (``HighShares.refill``); else both classes, HIGH first. False, changing no settled
        rate, if an edge resource or a pinned flow's resource is no longer clearly
        unsaturated at the new rates (those resources in ``failed``; then redo walking
        through them, or over the whole component)."""
        res, edge, flows, pinned = c.res, c.edge, c.flows, c.pinned
        cap, avail, new, rate, cnt = self.t.cap, self._scratch, self.new, self.t.rate, self._cnt
        m0, m1 = self.t.members
        t0, t1 = self.t.tot
        paths, cls = self.t.f_path, self.t.f_cls
        inf = math.inf
        capped = self._capped.among
        for r in edge:  # never a bottleneck here: filling only passes through
            avail[r] = inf
        high_share = 1.0 - self._floor
        high_left, shared = self._high_left, self._shared
        order: list[int] = []  # the filled class's flows in freezing order (_keep)
        base = self._bases
        base.clear()
        if c.level > 0.0:  # above the level: from what each cut left (Walk._walk_above)
            start, cut_of = c.start, c.cut
            tot = t1 if self._tm else t0
            for r in res:
                avail[r] = start[r]
                cnt[r] = tot[r] - cut_of[r]
            self._pin(c, pinned)
            fill_max_min(
                flows,
                capped(flows),
                c.sub,  # the flows above the cuts, per resource
                res,
                paths,
                new,
                avail,
                cnt,
                order,
            )
        elif low:
            for r in res:  # what HIGH left, plus the floor HIGH could not take
                left = high_left[r] + (cap[r] - cap[r] * high_share if shared[r] else 0.0)
                avail[r] = base[r] = left if left > 0.0 else 0.0
                cnt[r] = t1[r]
            if pinned:
                self._pin(c, pinned)
            if flows:
                fill_max_min(flows, capped(flows), m1, res, paths, new, avail, cnt, order)
        elif not self._tm:  # one class
            for r in res:
                avail[r] = base[r] = cap[r]
                cnt[r] = t0[r]
            self._pin(c, pinned)
            fill_max_min(flows, capped(flows), m0, res, paths, new, avail, cnt, order)
        else:
            high = [s for s in flows if not cls[s]]
            for r in res:
                avail[r] = cap[r] * high_share if t0[r] and t1[r] else cap[r]
                cnt[r] = t0[r]
            self._pin(c, [s for s in pinned if not cls[s]])
            fill_max_min(high, capped(high), m0, res, paths, new, avail, cnt)
            for r in res:  # LOW: what HIGH left, plus the floor HIGH could not take
                both = bool(t0[r] and t1[r])
                high_left[r] = avail[r]
                shared[r] = both
                left = avail[r] + (cap[r] - cap[r] * high_share if both else 0.0)
                avail[r] = base[r] = left if left > 0.0 else 0.0
                cnt[r] = t1[r]
            self._pin(c, [s for s in pinned if cls[s]])
            low_flows = [s for s in flows if cls[s]]
            fill_max_min(low_flows, capped(low_flows), m1, res, paths, new, avail, cnt, order)
        limit = c.limit
        edge_rate: dict[int, float] = {}
        if edge:
            frate, paths = self.t.f_rate, self.t.f_path
            gone = c.gone  # what flows that ended took (dirty edge resources)
            edge_rate = {r: rate[r] - gone.get(r, 0.0) for r in edge}
            for s in flows:
                old = frate[s]
                delta = new[s] - (old if old > 0.0 else 0.0)
                if delta != 0.0:
                    for r in paths[s]:
                        if r in edge_rate:
                            edge_rate[r] += delta
            failed = [r for r, x in edge_rate.items() if x > limit[r]]
            if failed:
                self.failed = failed
                return False
        if pinned:
            paths, rmark, epoch = self.t.f_path, c.rmark, c.epoch
            failed = []
            for s in pinned:  # the new rates of their resources (set below if all pass)
                for r in paths[s]:
                    if r in edge_rate:
                        x = edge_rate[r]
                    elif rmark[r] == epoch:  # in res
                        x = cap[r] - avail[r]
                    else:  # crossed by no flow re-rated here
                        x = rate[r]
                    if x > limit[r]:
                        failed.append(r)
            if failed:
                self.failed = failed
                return False
        for r in res:
            used = cap[r] - avail[r]
            rate[r] = used if used > 0.0 else 0.0
        for r, x in edge_rate.items():
            rate[r] = x if x > 0.0 and (t0[r] or t1[r]) else 0.0
        if self._local:
            if c.level > 0.0 or len(order) >= KEEP_MIN_FLOWS:
                self._keep(c, order)
            else:  # a small filling: keeping its subtractions costs more than it saves
                q = self._q_slot
                for r in res:
                    q[r] = None
                for r in edge:
                    q[r] = None
        return True

    def base(self, r: int) -> float:
        """What the filled class starts from on ``r`` (``assign``: LOW's share
        under the traffic manager, else the capacity)."""
        if not self._tm:
            return self.t.cap[r]
        cap = self.t.cap[r]
        left = self._high_left[r] + (cap - cap * (1.0 - self._floor) if self._shared[r] else 0.0)
        return left if left > 0.0 else 0.0

    def _keep(self, c: Component, order: list[int]) -> None:
        """Keep, per resource walked through, the subtractions of the filling that just
        passed (``order``: its flows in freezing order) after the prefix kept below
        ``c.level`` (from the base when 0); drop what edges kept (their flows moved)."""
        res, edge = c.res, c.edge
        q_slot, q_cmax, q_left, q_base = self._q_slot, self._q_cmax, self._q_left, self._q_base
        mark = self._k_mark
        stamp = self._k_stamp = self._k_stamp + 1
        if c.level > 0.0:
            cut_of, keep = c.cut, c.keep
            for r in res:
                mark[r] = stamp
                cut = cut_of[r]
                q = q_slot[r]
                if cut and q is not None:  # always, past Walk._walk_above
                    q_slot[r] = q[:cut]
                    q_cmax[r] = q_cmax[r][:cut]
                    kept = keep.get(r)
                    q_left[r] = kept if kept is not None else q_left[r][:cut]
                else:
                    q_slot[r], q_cmax[r], q_left[r] = [], [], []
                q_base[r] = self.base(r)
        else:
            base = self._bases
            for r in res:
                mark[r] = stamp
                q_slot[r], q_cmax[r], q_left[r] = [], [], []
                q_base[r] = base[r]
        new, paths = self.new, self.t.f_path
        for s in order:
            x = new[s]
            for r in paths[s]:
                if mark[r] == stamp:  # walked through (edges hold no subtraction)
                    left, cmax = q_left[r], q_cmax[r]
                    left.append((left[-1] if left else q_base[r]) - x)
                    cmax.append(cmax[-1] if cmax and cmax[-1] > x else x)
                    q_slot[r].append(s)  # type: ignore[union-attr]  # set above
        for r in edge:
            q_slot[r] = None

    def _pin(self, c: Component, pinned: list[int]) -> None:
        """Freeze pinned flows at their rate (so no bottleneck re-freezes them) and take
        that rate off the resources being recomputed (those ``c`` reached), before
        filling."""
        avail, cnt, rmark, epoch = self._scratch, self._cnt, c.rmark, c.epoch
        rate, new, paths = self.t.f_rate, self.new, self.t.f_path
        for s in pinned:
            x = rate[s]
            new[s] = x
            for r in paths[s]:
                if rmark[r] == epoch:
                    avail[r] -= x
                    cnt[r] -= 1
