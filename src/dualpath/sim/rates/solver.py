"""Rate recomputation of the fluid network (SPEC §6): which flows a start or an end can move,
and their new max-min rates.

``RateSolver`` is the network's rate component. It reads the flows' paths, classes and caps
from the shared ``FlowTable``, writes the resources' settled rates there, and hands the flows
it re-rated (new rates in ``new``) back to the network, which owns their timing.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from operator import truediv

from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.flowtable import FlowTable
from dualpath.sim.maxmin import fill_max_min
from dualpath.sim.rates.capped import CappedKeys
from dualpath.sim.rates.high import HighShares

SLACK_REL = 1e-6  # a resource below (1 - SLACK_REL) of its HIGH share is clearly unsaturated
MAX_RETRIES = 4  # local refills with more resources walked through before a whole-component one
INCREMENTAL = True  # keep each resource's subtractions and refill only above the change's level
LEVEL_MARGIN = 1e-6  # the prefix kept is strictly below (1 - LEVEL_MARGIN) of the lowest bound
KEEP_MIN_FLOWS = 64  # a filling from the bottom keeps its subtractions from this many flows


class RateSolver:
    """Recomputes rates once per instant, only where they can change.

    A change (start, end, cancel) marks the resources of its path dirty (``started``,
    ``ended``). At the settle (a loop event at ``Priority.SETTLE``, or earlier on any query
    through ``settle``): HIGH (traffic manager) is refilled apart where a HIGH flow changed
    or a resource's shared status flipped (``HighShares.refill``); LOW (or the single class) is
    refilled over the flows reachable from the dirty resources through resources that can be
    bottlenecks (``_component``); capped flows at their cap on clearly unsaturated resources
    are held. Guesses are checked after filling; a failed one is filled again locally with
    the resources that failed walked through (up to ``MAX_RETRIES`` times), then over the
    whole component, so the result is bit-identical to refilling whole components every time
    (``local=False``, the reference that ``tests/sim/test_network.py`` compares with).

    Its own state: the dirty sets of this instant, the HIGH shares (``_high_left``,
    ``_shared``), scratch lists for filling and walking, and counters. ``reschedule(flows,
    now)`` and ``arm()`` are the network's: apply the rates in ``new`` to ``flows``, and keep
    the completion timer at the next finish. ``deferred`` is the network's too: True while
    it fires completions and will call ``settle`` after them, so changes schedule no settle
    event (the same rates and the same processed events: such an event was always cancelled).
    """

    def __init__(
        self,
        loop: EventLoop,
        table: FlowTable,
        *,
        traffic_manager: bool,
        low_floor: float,
        reschedule: Callable[[list[int], float], None],
        arm: Callable[[], None],
        local: bool = True,
    ) -> None:
        self._loop = loop
        self.t = table
        self._tm = traffic_manager
        self._floor = low_floor
        self._reschedule = reschedule
        self._arm = arm
        self._local = local  # False: every settle refills whole components (the reference)
        # per resource: scratch for filling and walk marks. What HIGH left (``_high_left``,
        # ``_shared``, LOW's base) is the HIGH part's; it is refilled only where a HIGH flow
        # started or ended (``_dirty_high``) or a resource's ``_shared`` flipped.
        self._cnt: list[int] = []
        self._limit: list[float] = []  # capacity × _slack_limit: "clearly unsaturated" below
        self._scratch: list[float] = []
        self._rmark: list[int] = []
        # per flow slot: walk marks and the new rates of the flows re-rated
        self._f_mark: list[int] = []
        self._capped = CappedKeys(table)  # the freezing order of the capped flows of a filling
        self.new: list[float] = []
        self._high = HighShares(table, low_floor=low_floor, new=self.new)
        self._high_left, self._shared = self._high.left, self._high.shared
        # since the last settle: dirty resources, flows started (slots), rate left by ended
        # flows per resource, resources any recomputation must pass through (_component)
        self._dirty: dict[int, None] = {}
        self._dirty_high: dict[int, None] = {}
        self._new: list[int] = []
        self._gone: dict[int, float] = {}
        self._forced: dict[int, None] = {}
        self._settle_ev: Event | None = None
        # True while the network fires completions: it settles right after them itself, so
        # changes schedule no settle event (one that would only be cancelled unprocessed)
        self.deferred = False
        self._epoch = 0
        self._slack_limit = (1.0 - (low_floor if traffic_manager else 0.0)) * (1.0 - SLACK_REL)
        self._rearm = False  # a flow changed without a recomputation: re-arm at settle
        self.num_settles = 0  # recomputations (at most one per instant unless queried)
        self.num_settled_flows = 0  # sum over recomputations of the flows re-rated
        self.num_fallbacks = 0  # local settles redone over the whole component
        self.num_retries = 0  # local refills redone with more resources walked through
        self._failed: list[int] = []  # resources whose guess failed in the last _assign_rates
        # exact incremental filling (the filled class: LOW under the traffic manager, else
        # the only one): per resource, the subtractions of the last filling that walked
        # through it, in freezing order: slots, running maximum of their rates, what
        # was left after each, and the capacity it started from (``_q_base``); a kept
        # flow's rate is its current one. None: not
        # kept (an edge of a filling that re-rated its flows, or a flow shifted rates there).
        self._q_slot: list[list[int] | None] = []
        self._q_cmax: list[list[float]] = []
        self._q_left: list[list[float]] = []
        self._q_base: list[float] = []
        self._theta = math.inf  # this instant's lowest ended rate and started cap
        self._theta_now = math.inf  # the same, for the settle running
        self._level = 0.0  # the level the current settle keeps the prefix below (0: none)
        self._cut: dict[int, int] = {}  # per resource walked through: prefix length
        self._start: dict[int, float] = {}  # per resource walked through: left after it
        self._keep: dict[int, list[float]] = {}  # recomputed prefix columns (base changed)
        self._sub: dict[int, dict[int, None]] = {}  # per resource walked through: flows above
        self._bases: dict[int, float] = {}  # per resource walked through: the filling's base
        self._k_mark: list[int] = []  # per resource: walked through by the last kept filling
        self._k_stamp = 0
        self.num_incremental = 0  # settles that kept a prefix
        self.num_whole = 0  # settles that could not (no kept subtractions, or float checks)

    def add_resource(self, capacity: float) -> None:
        self._limit.append(capacity * self._slack_limit)
        self._cnt.append(0)
        self._scratch.append(0.0)
        self._rmark.append(-1)
        self._q_slot.append(None)
        self._q_cmax.append([])
        self._q_left.append([])
        self._q_base.append(0.0)
        self._k_mark.append(0)
        self._high.add_resource(capacity)

    def add_slot(self) -> None:
        self._f_mark.append(-1)
        self._capped.add_slot()
        self.new.append(0.0)
        self._high.add_slot()

    def started(self, slot: int, path: tuple[int, ...], high: bool) -> None:
        """A flow started that needs a recomputation (``high``: a HIGH flow, under the traffic
        manager)."""
        self._new.append(slot)
        t = self.t
        fcap = t.f_cap[slot]
        if not high and fcap < self._theta:
            self._theta = fcap
        if fcap == math.inf:  # it saturates a resource: walk through the likeliest
            c, rate, forced, limit = t.cap, t.rate, self._forced, self._limit
            tight, room = -1, 0.0
            for r in path:  # the first of the least headroom per crossing
                x = (c[r] - rate[r]) / path.count(r)
                if tight < 0 or x < room:
                    tight, room = r, x
            forced[tight] = None
            for r in path:  # and through those it takes past their limit at that rate
                if rate[r] + room * path.count(r) > limit[r]:
                    forced[r] = None
        self._mark_dirty(path, high)

    def ended(self, path: tuple[int, ...], rate: float, klass: int) -> None:
        """A flow of class ``klass`` (0 for all without the traffic manager) running at
        ``rate`` left ``path`` and needs a recomputation."""
        if 0.0 <= rate < self._theta and (klass or not self._tm):
            self._theta = rate  # the levels below it are unchanged (_walk_above)
        if rate > 0.0 and (klass or not self._tm):  # HIGH changes reach LOW via _high_left
            gone = self._gone
            for r in path:
                gone[r] = gone.get(r, 0.0) + rate
        self._mark_dirty(path, klass == 0 and self._tm)

    def unsaturated(
        self, slot: int, path: tuple[int, ...], add_rate: float, starting: bool
    ) -> bool:
        """Whether every resource of ``path``, carrying ``add_rate`` more per crossing, stays
        clearly below its HIGH share. Then it is a bottleneck neither before nor after a flow
        that crosses only such resources (and, when starting, runs at its cap ``add_rate``)
        starts or ends: every other flow's progressive filling runs the same operations on
        its bottlenecks, so its rate is exactly what a recomputation would give. With the
        traffic manager, only for a LOW flow that leaves every resource's ``_shared`` as it
        was (HIGH fills on shares that depend on it; ``HighShares.refill``)."""
        if not self._local:
            return False
        rate, limit = self.t.rate, self._limit
        if add_rate:
            for r in path:  # plain loops: this runs at every start and end of a flow
                if rate[r] + add_rate * path.count(r) > limit[r]:
                    return False
        else:  # the same test: rate + 0.0 is rate
            for r in path:  # a plain loop: no generator per end
                if rate[r] > limit[r]:
                    return False
        if not self._tm:
            return True
        if not self.t.f_cls[slot]:
            return False
        t0, t1 = self.t.tot
        if starting:  # the flow is counted already
            for r in path:  # noqa: SIM110  # a plain loop: no generator per start
                if t0[r] and t1[r] <= path.count(r):
                    return False
            return True
        for r in path:  # noqa: SIM110  # a plain loop: no generator per end
            if t0[r] and not t1[r]:
                return False
        return True

    def shift_rates(self, path: tuple[int, ...], delta: float) -> None:
        """A flow at rate ``|delta|`` started (+) or ended (-) without a recomputation:
        account resources at their old rates, then adjust them."""
        t = self.t
        now = self._loop.now
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
        self._rearm = True
        if self._settle_ev is None and not self.deferred:
            self._mark_dirty(())

    def _mark_dirty(self, path: tuple[int, ...], high: bool = False) -> None:
        """Mark ``path`` for recomputation (``high``: a HIGH flow's, under the traffic
        manager); an empty path (from a flow that changed without one) only makes sure the
        settle event of this instant is scheduled."""
        dirty = self._dirty
        for r in path:
            dirty[r] = None
        if high:
            dirty_high = self._dirty_high
            for r in path:
                dirty_high[r] = None
        if self._settle_ev is None and not self.deferred:
            self._settle_ev = self._loop.at(
                self._loop.now, self.settle, Priority.SETTLE, "net.settle"
            )

    def settle(self) -> bool:
        """Recompute rates of every flow in the components of the dirty resources. True when
        it re-armed the completion timer (``arm``), which it does whenever a flow changed."""
        event = self._settle_ev
        if event is not None:
            self._settle_ev = None
            self._loop.cancel(event)  # a no-op when it is the event running now
        self._theta_now, self._theta = self._theta, math.inf
        if not self._dirty:
            if self._rearm:
                self._rearm = False
                self._arm()
                return True
            return False
        self._rearm = False
        self.num_settles += 1
        now = self._loop.now
        dirty = list(self._dirty)
        self._dirty = {}
        forced = self._forced
        self._forced = {}
        high_flows: list[int] = []
        if self._local and self._tm:
            dirty_high = self._dirty_high
            if dirty_high:
                self._dirty_high = {}
            # may add to dirty and forced
            high_flows = self._high.refill(dirty, forced, dirty_high)
        # resources to walk through (forced, and those of failed guesses below) pin no flow
        # either: their limit is -1 during this settle (any choice of them is exact)
        limit = self._limit
        held: dict[int, float] = {}
        if self._local:
            for r in forced:
                held[r] = limit[r]
                limit[r] = -1.0
            res, edge, flows, pinned = self._component(dirty, True, forced)
            self.t.account(res, edge, now)
        ok = self._local and self._assign_rates(res, edge, flows, pinned, self._tm)
        if not ok and self._local:
            # a resource guessed unsaturated saturates: fill again, walking through it,
            # before a whole component
            for _ in range(MAX_RETRIES):
                self.num_retries += 1
                for r in self._failed:
                    held.setdefault(r, limit[r])
                    limit[r] = -1.0
                res, edge, flows, pinned = self._component(dirty, True, forced)
                self.t.account(res, edge, now)
                ok = self._assign_rates(res, edge, flows, pinned, self._tm)
                if ok:
                    break
        for r, x in held.items():
            limit[r] = x
        self._new.clear()
        self._gone.clear()
        if ok:
            flows = high_flows + flows
        else:
            self.num_fallbacks += self._local
            res, edge, flows, pinned = self._component(dirty, False, forced)
            self.t.account(res, [], now)
            self._assign_rates(res, edge, flows, pinned, False)
        self.num_settled_flows += len(flows)
        self._reschedule(flows, now)
        self._arm()
        return True

    def _component(
        self, dirty: list[int], local: bool, forced: dict[int, None]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """``_walk``, above the level where this settle's changes start to matter when the
        subtractions kept allow (``_walk_above``); sets ``_level`` (0.0: from the bottom)."""
        self._level = 0.0
        if local and INCREMENTAL and self._theta_now > 0.0 and self._kept_at(dirty, forced):
            got = self._walk_above(dirty, forced)
            if got is not None:
                self.num_incremental += 1
                return got
            self._level = 0.0
            self.num_whole += 1
        return self._walk(dirty, local, forced)

    def _kept_at(self, dirty: list[int], forced: dict[int, None]) -> bool:
        """Whether every dirty resource that will be walked through has kept subtractions
        (a quick test before ``_walk_above``, which needs them)."""
        q, rate, limit = self._q_slot, self.t.rate, self._limit
        for r in dirty:  # noqa: SIM110  # a plain loop: no generator per settle
            if q[r] is None and (r in forced or rate[r] > limit[r]):
                return False
        return True

    def _base(self, r: int) -> float:
        """What the filled class starts from on ``r`` (``_assign_rates``: LOW's share
        under the traffic manager, else the capacity)."""
        if not self._tm:
            return self.t.cap[r]
        cap = self.t.cap[r]
        left = self._high_left[r] + (cap - cap * (1.0 - self._floor) if self._shared[r] else 0.0)
        return left if left > 0.0 else 0.0

    def _walk_above(
        self, dirty: list[int], forced: dict[int, None]
    ) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """``_walk`` that leaves out the flows frozen below this settle's level ``θ`` in the
        last filling (exact: ``docs/simulator.md``, "Exact incremental max-min"), or None
        where it cannot (a resource walked through without kept subtractions, or a float
        check fails).

        ``θ`` is below every ended flow's old rate, every started flow's cap and, on each
        resource where flows of the class started or ended or the base changed, below the
        level it would saturate at with every flow unfrozen, old and new (progressive
        filling never lowers a resource's level). Up to ``θ``, the old and the new filling
        run the same steps, so the flows frozen there keep their rates, and each resource
        walked through starts from what its kept subtractions left at its cut (the first
        kept entry whose running maximum reaches ``θ``). Checked as floats: every changed
        resource's level at every kept entry stays at or above ``θ`` (old and new counts),
        and no flow above a cut has an old rate below ``θ`` (the cuts agree)."""
        epoch = self._epoch = self._epoch + 1
        rmark, fmark, paths = self._rmark, self._f_mark, self.t.f_path
        fcap, frate = self.t.f_cap, self.t.f_rate
        rate, limit = self.t.rate, self._limit
        tm = self._tm
        members = self.t.members[1 if tm else 0]
        tot = self.t.tot[1 if tm else 0]
        q_slot, q_cmax, q_left, q_base = self._q_slot, self._q_cmax, self._q_left, self._q_base
        flows: list[int] = []
        pinned: list[int] = []
        edge: list[int] = []
        res: list[int] = []
        keep_margin = 1.0 - LEVEL_MARGIN
        theta = self._theta_now * keep_margin
        changed: dict[int, float] = {}
        for r in dirty:
            rmark[r] = epoch
            if r in forced or rate[r] > limit[r]:
                q = q_slot[r]
                if q is None:
                    return None
                res.append(r)
                base, old = self._base(r), q_base[r]
                changed[r] = base
                n = max(len(q), tot[r])  # q holds the old count
                if n:
                    low = (base if base < old else old) / n
                    if low * keep_margin < theta:
                        theta = low * keep_margin
            else:
                edge.append(r)  # a guess; _assign_rates checks after
        if not theta > 0.0:
            return None
        cls = self.t.f_cls
        for s in self._new:  # their resources are all dirty, so marked already
            if fmark[s] != epoch and paths[s] and frate[s] == -1.0 and (cls[s] or not tm):
                fmark[s] = epoch
                flows.append(s)
        new_at: dict[int, list[int]] = {}  # the new flows on each changed resource
        for s in flows:
            for r in paths[s]:
                if r in changed:
                    new_at.setdefault(r, []).append(s)
        cut_of, start, keep, sub = self._cut, self._start, self._keep, self._sub
        cut_of.clear()
        start.clear()
        keep.clear()
        sub.clear()
        pin = self.t.num_capped > 0
        add_res, add_flow, add_pinned, add_edge = (
            res.append,
            flows.append,
            pinned.append,
            edge.append,
        )
        for r in res:  # grows while iterated: a breadth-first walk
            q = q_slot[r]
            if q is None:
                return None
            cut = bisect_left(q_cmax[r], theta)
            base = changed.get(r, -1.0)
            if base < 0.0:  # reached, not changed: its base is as kept, or give up
                base = self._base(r)
                if base != q_base[r]:
                    return None
                left = q_left[r]
            elif base != q_base[r]:  # the prefix again, from the new base
                left = []
                a = base
                for s in q[:cut]:
                    a -= frate[s]
                    left.append(a)
                keep[r] = left
            else:
                left = q_left[r]
            if cut and r in changed:  # its level after every kept entry, old and new
                n = max(len(q), tot[r]) - 1  # unfrozen after the first entry (the larger)
                k = cut if cut < n else n
                for col in (left, q_left[r]) if left is not q_left[r] else (left,):
                    # left / unfrozen after each entry (a left <= 0 fails as its level 0
                    # would: θ > 0)
                    if k and min(map(truediv, col[:k], range(n, n - k, -1))) < theta:
                        return None
            cut_of[r] = cut
            start[r] = left[cut - 1] if cut else base
            m = members[r]
            live = sub[r] = dict.fromkeys([s for s in (q[cut:] if cut else q) if s in m])
            for s in new_at.get(r, ()):
                live[s] = None
            for s in live:
                if fmark[s] != epoch:
                    if frate[s] < theta:  # frozen below θ after a cut: the cuts disagree
                        return None
                    fmark[s] = epoch
                    if pin and frate[s] == fcap[s]:
                        for r2 in paths[s]:  # a guess; _assign_rates checks after
                            if rate[r2] > limit[r2]:
                                break
                        else:
                            add_pinned(s)
                            continue
                    add_flow(s)
                    for r2 in paths[s]:
                        if rmark[r2] != epoch:
                            rmark[r2] = epoch
                            if rate[r2] <= limit[r2]:
                                add_edge(r2)  # a guess; _assign_rates checks after
                            else:
                                add_res(r2)
        self._level = theta
        return res, edge, flows, pinned

    def _walk(
        self, dirty: list[int], local: bool, forced: dict[int, None]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The flows whose rates a change on the dirty resources can move, and the resources
        they cross: ``(res, edge, flows, pinned)``.

        Walks breadth-first from the dirty resources through shared resources. With
        ``local``, the walk does not pass through a resource that is clearly unsaturated
        (below ``_slack_limit`` of capacity at its settled rate), unless ``forced`` (an
        uncapped flow that started there may take it past its limit (``started``), or what
        HIGH leaves there changed): such a resource is
        no flow's bottleneck, so it couples nobody's rate. It is returned in ``edge`` (its
        other flows keep their rates); flows that started are taken in directly. Capped flows
        running at their cap on clearly unsaturated resources are not re-rated either
        (``pinned``). ``_assign_rates`` checks after filling that every edge resource (and
        every pinned flow's resource) is still clearly unsaturated; if one is not, the settle
        is redone with those resources treated as saturated (walked through, pinning nobody;
        ``settle``), and without ``local``, over the whole connected component, if that keeps
        failing. The argument below holds for any set of resources walked through. When the check
        passes, the result is what progressive filling over the whole component gives, bit
        for bit: the filling of flows coupled only through never-saturating resources runs
        the same operations, in the same (level, resource id) order, together or apart.
        """
        self._epoch += 1
        epoch = self._epoch
        rmark, fmark, paths = self._rmark, self._f_mark, self.t.f_path
        fcap, frate = self.t.f_cap, self.t.f_rate
        rate, limit = self.t.rate, self._limit
        flows: list[int] = []
        pinned: list[int] = []
        edge: list[int] = []
        res: list[int] = []
        for r in dirty:
            rmark[r] = epoch
            if not local or r in forced or rate[r] > limit[r]:
                res.append(r)
            else:
                edge.append(r)  # a guess; _assign_rates checks after
        if local:
            cls, tm = self.t.f_cls, self._tm
            for s in self._new:  # their resources are all dirty, so marked already
                if fmark[s] != epoch and paths[s] and frate[s] == -1.0 and (cls[s] or not tm):
                    fmark[s] = epoch
                    flows.append(s)
        pin = local and self.t.num_capped > 0
        m0, m1 = self.t.members
        walk = (m1,) if local and self._tm else (m0, m1)  # HIGH was settled apart
        add_res, add_flow, add_pinned, add_edge = (
            res.append,
            flows.append,
            pinned.append,
            edge.append,
        )
        for r in res:  # grows while iterated: a breadth-first walk
            for members in walk:
                for s in members[r]:
                    if fmark[s] != epoch:
                        fmark[s] = epoch
                        if pin and frate[s] == fcap[s]:
                            for r2 in paths[s]:  # a guess; _assign_rates checks after
                                if rate[r2] > limit[r2]:
                                    break
                            else:
                                add_pinned(s)
                                continue
                        add_flow(s)
                        for r2 in paths[s]:
                            if rmark[r2] != epoch:
                                rmark[r2] = epoch
                                if local and rate[r2] <= limit[r2]:
                                    add_edge(r2)  # a guess; _assign_rates checks after
                                else:
                                    add_res(r2)
        return res, edge, flows, pinned

    def _assign_rates(
        self, res: list[int], edge: list[int], flows: list[int], pinned: list[int], low: bool
    ) -> bool:
        """New rates into ``_f_new``; resource rate sums = capacity minus what is left (for
        ``edge`` resources: old sum plus the changes). Pinned flows keep their rate. ``low``
        (traffic manager): ``flows`` are LOW, filled on what HIGH left (``HighShares.refill``);
        else both classes, HIGH first. False, changing no settled rate, if an edge resource
        or a pinned flow's resource is no longer clearly unsaturated at the new rates (those
        resources in ``_failed``; then redo walking through them, or over the whole
        component)."""
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
        order: list[int] = []  # the filled class's flows in freezing order (_keep_fill)
        base = self._bases
        base.clear()
        if self._level > 0.0:  # above the level: from what each cut left (_walk_above)
            start, cut_of = self._start, self._cut
            tot = t1 if self._tm else t0
            for r in res:
                avail[r] = start[r]
                cnt[r] = tot[r] - cut_of[r]
            self._pin(pinned)
            fill_max_min(
                flows,
                capped(flows),
                self._sub,  # the flows above the cuts, per resource
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
                self._pin(pinned)
            if flows:
                fill_max_min(flows, capped(flows), m1, res, paths, new, avail, cnt, order)
        elif not self._tm:  # one class
            for r in res:
                avail[r] = base[r] = cap[r]
                cnt[r] = t0[r]
            self._pin(pinned)
            fill_max_min(flows, capped(flows), m0, res, paths, new, avail, cnt, order)
        else:
            high = [s for s in flows if not cls[s]]
            for r in res:
                avail[r] = cap[r] * high_share if t0[r] and t1[r] else cap[r]
                cnt[r] = t0[r]
            self._pin([s for s in pinned if not cls[s]])
            fill_max_min(high, capped(high), m0, res, paths, new, avail, cnt)
            for r in res:  # LOW: what HIGH left, plus the floor HIGH could not take
                both = bool(t0[r] and t1[r])
                high_left[r] = avail[r]
                shared[r] = both
                left = avail[r] + (cap[r] - cap[r] * high_share if both else 0.0)
                avail[r] = base[r] = left if left > 0.0 else 0.0
                cnt[r] = t1[r]
            self._pin([s for s in pinned if cls[s]])
            low_flows = [s for s in flows if cls[s]]
            fill_max_min(low_flows, capped(low_flows), m1, res, paths, new, avail, cnt, order)
        limit = self._limit
        edge_rate: dict[int, float] = {}
        if edge:
            frate, paths = self.t.f_rate, self.t.f_path
            gone = self._gone  # what flows that ended took (dirty edge resources)
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
                self._failed = failed
                return False
        if pinned:
            paths, rmark, epoch = self.t.f_path, self._rmark, self._epoch
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
                self._failed = failed
                return False
        for r in res:
            used = cap[r] - avail[r]
            rate[r] = used if used > 0.0 else 0.0
        for r, x in edge_rate.items():
            rate[r] = x if x > 0.0 and (t0[r] or t1[r]) else 0.0
        if self._local:
            if self._level > 0.0 or len(order) >= KEEP_MIN_FLOWS:
                self._keep_fill(res, edge, order)
            else:  # a small filling: keeping its subtractions costs more than it saves
                q = self._q_slot
                for r in res:
                    q[r] = None
                for r in edge:
                    q[r] = None
        return True

    def _keep_fill(self, res: list[int], edge: list[int], order: list[int]) -> None:
        """Keep, per resource walked through, the subtractions of the filling that just
        passed (``order``: its flows in freezing order) after the prefix kept below
        ``_level`` (from the base when 0); drop what edges kept (their flows moved)."""
        q_slot, q_cmax, q_left, q_base = self._q_slot, self._q_cmax, self._q_left, self._q_base
        mark = self._k_mark
        stamp = self._k_stamp = self._k_stamp + 1
        if self._level > 0.0:
            cut_of, keep = self._cut, self._keep
            for r in res:
                mark[r] = stamp
                cut = cut_of[r]
                q = q_slot[r]
                if cut and q is not None:  # always, past _walk_above
                    q_slot[r] = q[:cut]
                    q_cmax[r] = q_cmax[r][:cut]
                    kept = keep.get(r)
                    q_left[r] = kept if kept is not None else q_left[r][:cut]
                else:
                    q_slot[r], q_cmax[r], q_left[r] = [], [], []
                q_base[r] = self._base(r)
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

    def _pin(self, pinned: list[int]) -> None:
        """Freeze pinned flows at their rate (so no bottleneck re-freezes them) and take
        that rate off the resources being recomputed, before filling."""
        avail, cnt, rmark, epoch = self._scratch, self._cnt, self._rmark, self._epoch
        rate, new, paths = self.t.f_rate, self.new, self.t.f_path
        for s in pinned:
            x = rate[s]
            new[s] = x
            for r in paths[s]:
                if rmark[r] == epoch:
                    avail[r] -= x
                    cnt[r] -= 1
