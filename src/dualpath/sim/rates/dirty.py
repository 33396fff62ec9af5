"""This instant's changes to the fluid network's rates (design §6): which resources a start, end
or cancel made dirty, and whether a change needs a recomputation at all (``unsaturated``).

``DirtySet`` owns the changes since the last settle and each resource's "clearly unsaturated"
limit; the walk (``walk.py``) reads them, the fill checks its guesses against them. It reads
the table and changes no rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dualpath.sim.flowtable import FlowTable

SLACK_REL = 1e-6  # a resource below (1 - SLACK_REL) of its HIGH share is clearly unsaturated


class DirtySet:
    """The changes of this instant, handed to the settle (``take``).

    A change (start, end, cancel) marks the resources of its path dirty (``started``,
    ``ended``); one that cannot move another flow's rate is told apart first
    (``unsaturated``) and marks nothing.

    Its own state, since the last settle: dirty resources (and those of HIGH flows), the
    flows started (``started_slots``), the rate ended flows left per resource (``gone``),
    the resources any walk must pass through (forced) and the lowest ended rate and started
    cap (``θ``). Per resource: ``limit``, capacity × ``_slack_limit`` ("clearly unsaturated"
    below), -1 for the resources ``hold`` makes walked through during a settle.
    """

    def __init__(
        self, table: FlowTable, *, traffic_manager: bool, low_floor: float, local: bool
    ) -> None:
        self.t = table
        self._tm = traffic_manager
        self._local = local  # False: every settle refills whole components (the reference)
        self._slack_limit = (1.0 - (low_floor if traffic_manager else 0.0)) * (1.0 - SLACK_REL)
        self.limit: list[float] = []
        self._held: dict[int, float] = {}  # limits ``hold`` set to -1 during the settle
        # since the last settle: dirty resources (of HIGH flows too), flows started (slots),
        # rate left by ended flows per resource, resources any walk must pass through
        self._dirty: dict[int, None] = {}
        self._dirty_high: dict[int, None] = {}
        self.started_slots: list[int] = []
        self.gone: dict[int, float] = {}
        self._forced: dict[int, None] = {}
        self._theta = math.inf  # this instant's lowest ended rate and started cap

    def add_resource(self, capacity: float) -> None:
        self.limit.append(capacity * self._slack_limit)

    def started(self, slot: int, path: tuple[int, ...], high: bool) -> None:
        """A flow started that needs a recomputation (``high``: a HIGH flow, under the traffic
        manager)."""
        self.started_slots.append(slot)
        t = self.t
        fcap = t.f_cap[slot]
        if not high and fcap < self._theta:
            self._theta = fcap
        if fcap == math.inf:  # it saturates a resource: walk through the likeliest
            c, rate, forced, limit = t.cap, t.rate, self._forced, self.limit
            tight, room = -1, 0.0
            for r in path:  # the first of the least headroom per crossing
                x = (c[r] - rate[r]) / path.count(r)
                if tight < 0 or x < room:
                    tight, room = r, x
            forced[tight] = None
            for r in path:  # and through those it takes past their limit at that rate
                if rate[r] + room * path.count(r) > limit[r]:
                    forced[r] = None
        dirty = self._dirty  # the marking, inlined: this runs at every start
        for r in path:
            dirty[r] = None
        if high:
            dirty_high = self._dirty_high
            for r in path:
                dirty_high[r] = None

    def ended(self, path: tuple[int, ...], rate: float, klass: int) -> None:
        """A flow of class ``klass`` (0 for all without the traffic manager) running at
        ``rate`` left ``path`` and needs a recomputation."""
        if 0.0 <= rate < self._theta and (klass or not self._tm):
            self._theta = rate  # the levels below it are unchanged (``Walk._walk_above``)
        if rate > 0.0 and (klass or not self._tm):  # HIGH changes reach LOW via what HIGH left
            gone = self.gone
            for r in path:
                gone[r] = gone.get(r, 0.0) + rate
        dirty = self._dirty  # the marking, inlined: this runs at every end
        for r in path:
            dirty[r] = None
        if klass == 0 and self._tm:
            dirty_high = self._dirty_high
            for r in path:
                dirty_high[r] = None

    def unsaturated(
        self, slot: int, path: tuple[int, ...], add_rate: float, starting: bool
    ) -> bool:
        """Whether every resource of ``path``, carrying ``add_rate`` more per crossing, stays
        clearly below its HIGH share. Then it is a bottleneck neither before nor after a flow
        that crosses only such resources (and, when starting, runs at its cap ``add_rate``)
        starts or ends: every other flow's progressive filling runs the same operations on
        its bottlenecks, so its rate is exactly what a recomputation would give. With the
        traffic manager, only for a LOW flow that leaves every resource's ``shared`` as it
        was (HIGH fills on shares that depend on it; ``HighShares.refill``)."""
        if not self._local:
            return False
        rate, limit = self.t.rate, self.limit
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

    def take(self) -> tuple[list[int], dict[int, None], dict[int, None], float] | None:
        """Start a settle: ``(dirty, forced, dirty_high, θ)``, the resources marked since the
        last one (in order of marking), those any walk must pass through, those a HIGH flow
        started or ended on, and the lowest ended rate and started cap of the filled class;
        None, taking nothing, when none is dirty."""
        theta, self._theta = self._theta, math.inf
        if not self._dirty:
            return None
        dirty = list(self._dirty)
        self._dirty = {}
        forced = self._forced
        self._forced = {}
        dirty_high = self._dirty_high
        if dirty_high:
            self._dirty_high = {}
        return dirty, forced, dirty_high, theta

    def hold(self, resources: Iterable[int]) -> None:
        """Walk through ``resources`` for the rest of this settle, pinning no flow on them:
        their limit is -1 until ``done`` (any choice of resources walked through is
        exact)."""
        limit, held = self.limit, self._held
        for r in resources:
            held.setdefault(r, limit[r])
            limit[r] = -1.0

    def done(self) -> None:
        """The settle's walks are over: limits back, this instant's started flows and ended
        rates forgotten."""
        limit = self.limit
        for r, x in self._held.items():
            limit[r] = x
        self._held.clear()
        self.started_slots.clear()
        self.gone.clear()
