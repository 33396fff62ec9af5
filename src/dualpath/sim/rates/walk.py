"""The walk from this instant's dirty resources (design §6): which flows a recomputation must
re-rate, and, where the fill kept its subtractions, from which level up.

``Walk`` owns the walk marks and what the last walk found (a ``Component``, which the fill
reads). It reads the table, the dirty set's limits and changes, and the fill's kept
subtractions (lists shared by reference); it changes no rate.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from operator import truediv

from dualpath.sim.flowtable import FlowTable

INCREMENTAL = True  # keep each resource's subtractions and refill only above the change's level
LEVEL_MARGIN = 1e-6  # the prefix kept is strictly below (1 - LEVEL_MARGIN) of the lowest bound

# the fill's kept subtractions, per resource: slots (None: not kept), running maximum of
# their rates, what was left after each, and the base it started from (``IncrementalFill``)
Kept = tuple[list[list[int] | None], list[list[float]], list[list[float]], list[float]]


class Component:
    """What the last walk found, for the fill (``Walk.component``; one object that every walk
    fills again).

    ``res``: the resources walked through (their flows of the filled class are refilled);
    ``edge``: those reached but guessed clearly unsaturated (their other flows keep their
    rates); ``flows``: the flows to re-rate; ``pinned``: capped flows at their cap on clearly
    unsaturated resources (held at their rates). A resource was reached (in ``res`` or
    ``edge``) when ``rmark[r] == epoch``. ``level`` is 0.0, or the level ``θ`` below which the
    walk kept each resource's prefix of subtractions (``Walk._walk_above``); then, per
    resource walked through: ``cut`` (the prefix's length), ``start`` (what was left after
    it), ``keep`` (the prefix's column of what was left, recomputed where the base changed)
    and ``sub`` (its flows above the cut). The guesses are checked against ``limit`` (each
    resource's "clearly unsaturated" bound) and ``gone`` (the rate ended flows took off each
    dirty resource), the dirty set's.
    """

    __slots__ = (
        "cut",
        "edge",
        "epoch",
        "flows",
        "gone",
        "keep",
        "level",
        "limit",
        "pinned",
        "res",
        "rmark",
        "start",
        "sub",
    )

    def __init__(self, rmark: list[int], limit: list[float], gone: dict[int, float]) -> None:
        self.res: list[int] = []
        self.edge: list[int] = []
        self.flows: list[int] = []
        self.pinned: list[int] = []
        self.level = 0.0
        self.epoch = 0
        self.rmark = rmark
        self.limit = limit
        self.gone = gone
        self.cut: dict[int, int] = {}
        self.start: dict[int, float] = {}
        self.keep: dict[int, list[float]] = {}
        self.sub: dict[int, dict[int, None]] = {}


class Walk:
    """From the dirty resources, through resources that can be bottlenecks, to the flows
    whose rates a change can move (``component``).

    Its own state: walk marks (per resource and per flow slot), the ``Component`` and
    counters. It reads ``limit`` (each resource's "clearly unsaturated" bound), the flows
    started this instant and the rates ended flows left (``gone``), all the dirty set's;
    ``kept``, the fill's subtractions; and ``base(r)``, what the filled class starts from on
    ``r`` (``IncrementalFill.base``).
    """

    def __init__(
        self,
        table: FlowTable,
        *,
        traffic_manager: bool,
        limit: list[float],
        started: list[int],
        gone: dict[int, float],
        kept: Kept,
        base: Callable[[int], float],
    ) -> None:
        self.t = table
        self._tm = traffic_manager
        self._limit = limit
        self._started = started
        self._q_slot, self._q_cmax, self._q_left, self._q_base = kept
        self._base = base
        self._rmark: list[int] = []  # walk marks, per resource and per flow slot
        self._f_mark: list[int] = []
        self._epoch = 0
        self._comp = Component(self._rmark, limit, gone)
        self.num_incremental = 0  # settles that kept a prefix
        self.num_whole = 0  # settles that could not (no kept subtractions, or float checks)

    def add_resource(self) -> None:
        self._rmark.append(-1)

    def add_slot(self) -> None:
        self._f_mark.append(-1)

    def component(
        self, dirty: list[int], local: bool, forced: dict[int, None], lowest: float
    ) -> Component:
        """``_walk``, above the level where this settle's changes start to matter when the
        subtractions kept allow (``_walk_above``; ``lowest``: this instant's lowest ended
        rate and started cap, ``DirtySet.take``); sets the component's ``level`` (0.0: from
        the bottom)."""
        if local and INCREMENTAL and lowest > 0.0 and self._kept_at(dirty, forced):
            got = self._walk_above(dirty, forced, lowest)
            if got is not None:
                self.num_incremental += 1
                return got
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

    def _walk_above(
        self, dirty: list[int], forced: dict[int, None], lowest: float
    ) -> Component | None:
        """``_walk`` that leaves out the flows frozen below this settle's level ``θ`` in the
        last filling (exact: ``docs/simulator.md``, "Exact incremental max-min"), or None
        where it cannot (a resource walked through without kept subtractions, or a float
        check fails).

        ``θ`` is below every ended flow's old rate, every started flow's cap (``lowest``)
        and, on each resource where flows of the class started or ended or the base changed,
        below the level it would saturate at with every flow unfrozen, old and new
        (progressive filling never lowers a resource's level). Up to ``θ``, the old and the
        new filling run the same steps, so the flows frozen there keep their rates, and each
        resource walked through starts from what its kept subtractions left at its cut (the
        first kept entry whose running maximum reaches ``θ``). Checked as floats: every
        changed resource's level at every kept entry stays at or above ``θ`` (old and new
        counts), and no flow above a cut has an old rate below ``θ`` (the cuts agree)."""
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
        theta = lowest * keep_margin
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
                edge.append(r)  # a guess; the fill checks after
        if not theta > 0.0:
            return None
        cls = self.t.f_cls
        for s in self._started:  # their resources are all dirty, so marked already
            if fmark[s] != epoch and paths[s] and frate[s] == -1.0 and (cls[s] or not tm):
                fmark[s] = epoch
                flows.append(s)
        new_at: dict[int, list[int]] = {}  # the new flows on each changed resource
        for s in flows:
            for r in paths[s]:
                if r in changed:
                    new_at.setdefault(r, []).append(s)
        c = self._comp
        cut_of, start, keep, sub = c.cut, c.start, c.keep, c.sub
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
                        for r2 in paths[s]:  # a guess; the fill checks after
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
                                add_edge(r2)  # a guess; the fill checks after
                            else:
                                add_res(r2)
        c.res, c.edge, c.flows, c.pinned, c.level, c.epoch = res, edge, flows, pinned, theta, epoch
        return c

    def _walk(self, dirty: list[int], local: bool, forced: dict[int, None]) -> Component:
        """The flows whose rates a change on the dirty resources can move, and the resources
        they cross: the component's ``res``, ``edge``, ``flows`` and ``pinned``.

        Walks breadth-first from the dirty resources through shared resources. With
        ``local``, the walk does not pass through a resource that is clearly unsaturated
        (below its ``limit``, ``DirtySet._slack_limit`` of capacity, at its settled rate),
        unless ``forced`` (an uncapped flow that started there may take it past its limit
        (``DirtySet.started``), or what HIGH leaves there changed): such a resource is no
        flow's bottleneck, so it couples nobody's rate. It is returned in ``edge`` (its other
        flows keep their rates); flows that started are taken in directly. Capped flows
        running at their cap on clearly unsaturated resources are not re-rated either
        (``pinned``). The fill (``IncrementalFill.assign``) checks after filling that every
        edge resource (and every pinned flow's resource) is still clearly unsaturated; if one
        is not, the settle is redone with those resources treated as saturated (walked
        through, pinning nobody; ``DirtySet.hold``, ``RateSolver.settle``), and without
        ``local``, over the whole connected component, if that keeps failing. The argument
        below holds for any set of resources walked through. When the check passes, the
        result is what progressive filling over the whole component gives, bit for bit: the
        filling of flows coupled only through never-saturating resources runs the same
        operations, in the same (level, resource id) order, together or apart.
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
                edge.append(r)  # a guess; the fill checks after
        if local:
            cls, tm = self.t.f_cls, self._tm
            for s in self._started:  # their resources are all dirty, so marked already
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
                            for r2 in paths[s]:  # a guess; the fill checks after
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
                                    add_edge(r2)  # a guess; the fill checks after
                                else:
                                    add_res(r2)
        c = self._comp
        c.res, c.edge, c.flows, c.pinned, c.level, c.epoch = res, edge, flows, pinned, 0.0, epoch
        return c
