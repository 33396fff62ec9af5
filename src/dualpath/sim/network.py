"""Fluid network: flows over paths of capacity resources at max-min fair rates (SPEC §6).

Owns resources (capacity, bytes carried, busy time) and flows (remaining bytes, rate,
completion). Rates change only when a flow starts or ends, and are recomputed only for the
connected component touched. Knows nothing of engines, KV blocks or policies.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Callable, Sequence

from dualpath.sim.events import Event, EventLoop
from dualpath.sim.maxmin import fill_max_min
from dualpath.types import TrafficClass

DONE_REL = 1e-9  # a flow is done once remaining <= DONE_REL * size
SETTLE_PRIORITY = 2**62  # rate recomputation runs after every other event of its instant
SLACK_REL = 1e-6  # a resource below (1 - SLACK_REL) of its HIGH share is clearly unsaturated


class FluidNetwork:
    """Resources with capacities (bytes/s) shared by flows, each a path of resources.

    Rates: max-min fair by progressive filling; a per-flow ``max_rate_bytes_per_s`` acts as a
    private link. With ``traffic_manager`` (SPEC §6, work-conserving WRR), on every resource
    that carries both classes HIGH may use at most ``(1 - low_floor)`` of capacity; HIGH is
    filled first (max-min among HIGH), then LOW max-min on what is left, so LOW gets at least
    ``low_floor`` of such a resource plus whatever HIGH leaves idle. (Approximation: HIGH is
    held to its share even when the LOW flows there are bottlenecked below ``low_floor``.)
    Without it, one class, plain max-min on full capacities. A resource listed k times in a
    path carries that flow k times (e.g. half-duplex DRAM read and written by one transfer).

    Timing: starts, cancels and completions mark resources dirty; rates are recomputed once
    per instant (a loop event at ``SETTLE_PRIORITY``, or earlier on any query), which is exact
    since no time passes in between. Skipped as exactly redundant: a capped flow starting or
    ending on resources that stay clearly unsaturated (it runs at its cap, nobody else's rate
    moves), and, within a recomputation, capped flows at their cap on such resources.
    Completions are fired by one loop event (``priority``, label ``net.done``); flows
    finishing at the same instant get ``on_done()`` in order of (finish time, flow id).
    Zero-size flows complete at ``now`` through the loop too.
    """

    def __init__(
        self,
        loop: EventLoop,
        traffic_manager: bool = True,
        low_floor: float = 0.01,
        priority: int = 0,
    ) -> None:
        if not 0.0 <= low_floor < 1.0:
            raise ValueError(f"low_floor={low_floor!r} is invalid: must be in [0, 1)")
        self._loop = loop
        self._tm = bool(traffic_manager)
        self._floor = float(low_floor)
        self._priority = priority
        # resources, indexed by resource id
        self._cap: list[float] = []
        self._names: dict[str, int] = {}
        self._members: tuple[list[dict[int, int]], list[dict[int, int]]] = ([], [])
        self._tot: tuple[list[int], list[int]] = ([], [])  # sum of multiplicities in _members
        self._cnt: list[int] = []  # scratch for fill_max_min
        self._rate: list[float] = []  # settled total rate through each resource
        self._carried: list[float] = []
        self._last_s: list[float] = []
        self._busy_s: list[float] = []
        self._scratch: list[float] = []
        self._rmark: list[int] = []
        # flows, indexed by slot; slots are reused, flow ids are not
        self._f_id: list[int] = []
        self._f_path: list[tuple[int, ...]] = []
        self._f_cls: list[int] = []
        self._f_size: list[float] = []
        self._f_rem: list[float] = []  # remaining bytes at time _f_t
        self._f_t: list[float] = []
        self._f_rate: list[float] = []
        self._f_cap: list[float] = []
        self._f_done: list[Callable[[], object] | None] = []
        self._f_ver: list[int] = []  # bumps invalidate finish-heap entries
        self._f_mark: list[int] = []
        self._f_new: list[float] = []
        self._free: list[int] = []
        self._slot_of: dict[int, int] = {}
        self._next_id = 0
        self._finish: list[tuple[float, int, int, int]] = []  # (finish_s, flow id, slot, ver)
        self._timer: Event | None = None
        self._timer_s = math.nan
        self._dirty: dict[int, None] = {}
        # since the last settle: flows started (slots), rate left by ended flows per resource,
        # resources any recomputation must pass through (see _component)
        self._new: list[int] = []
        self._gone: dict[int, float] = {}
        self._forced: dict[int, None] = {}
        # traffic manager: HIGH is filled on its own (it does not see LOW rates); per resource,
        # what the last HIGH filling left (``_high_left``) and whether both classes were
        # there (``_shared``), which is what LOW fills on. HIGH is refilled only where a HIGH
        # flow started or ended (``_dirty_high``) or a resource's ``_shared`` flipped.
        self._dirty_high: dict[int, None] = {}
        self._high_left: list[float] = []
        self._shared: list[bool] = []
        self._settle_ev: Event | None = None
        self._epoch = 0
        self._num_capped = 0  # live flows with a finite rate cap
        self._slack_limit = (1.0 - (self._floor if self._tm else 0.0)) * (1.0 - SLACK_REL)
        self._rearm = False  # a flow changed without a recomputation: re-arm at settle
        self._num_settles = 0
        self._num_settled_flows = 0
        self._num_fallbacks = 0  # local settles redone over the whole component
        self._local = True  # False: every settle refills whole components (tests' reference)

    # -- resources -------------------------------------------------------------------------

    def add_resource(self, name: str, capacity_bytes_per_s: float) -> int:
        """Add a resource; returns its id (0, 1, 2, ... in order of addition)."""
        if not isinstance(name, str) or not name or name in self._names:
            raise ValueError(f"resource name={name!r} is invalid: must be a new non-empty str")
        if not 0.0 < capacity_bytes_per_s < math.inf:
            raise ValueError(
                f"resource {name!r} capacity_bytes_per_s={capacity_bytes_per_s!r} is invalid:"
                " must be finite and > 0"
            )
        rid = len(self._cap)
        self._names[name] = rid
        self._cap.append(float(capacity_bytes_per_s))
        for lst in (*self._members,):
            lst.append({})
        for tot in (*self._tot, self._cnt):
            tot.append(0)
        self._rate.append(0.0)
        self._high_left.append(float(capacity_bytes_per_s))
        self._shared.append(False)
        self._carried.append(0.0)
        self._last_s.append(self._loop.now)
        self._busy_s.append(0.0)
        self._scratch.append(0.0)
        self._rmark.append(-1)
        return rid

    @property
    def num_resources(self) -> int:
        return len(self._cap)

    def resource_id(self, name: str) -> int:
        if name not in self._names:
            raise ValueError(f"unknown resource name {name!r}")
        return self._names[name]

    def capacity(self, resource_id: int) -> float:
        """Capacity in bytes/s."""
        return self._cap[self._check_rid(resource_id)]

    def bytes_carried(self, resource_id: int) -> float:
        """Bytes the resource has carried up to ``now`` (a flow crossing it k times counts k
        times)."""
        r = self._check_rid(resource_id)
        self._settle()
        return self._carried[r] + self._rate[r] * (self._loop.now - self._last_s[r])

    def busy_time_s(self, resource_id: int) -> float:
        """Seconds up to ``now`` during which the resource carried a positive rate."""
        r = self._check_rid(resource_id)
        self._settle()
        busy = self._rate[r] > 0.0
        return self._busy_s[r] + (self._loop.now - self._last_s[r] if busy else 0.0)

    def _check_rid(self, resource_id: int) -> int:
        r = operator.index(resource_id)
        if not 0 <= r < len(self._cap):
            raise ValueError(f"resource_id={resource_id!r} is invalid: have {len(self._cap)}")
        return r

    # -- flows -----------------------------------------------------------------------------

    def start_flow(
        self,
        path: Sequence[int],
        size_bytes: float,
        klass: TrafficClass,
        on_done: Callable[[], object],
        max_rate_bytes_per_s: float = math.inf,
    ) -> int:
        """Start moving ``size_bytes`` across every resource of ``path``; ``on_done()`` runs
        (from the loop) when the last byte arrives. Returns the flow id."""
        num_res, check = len(self._cap), self._check_rid
        rids = tuple(r if type(r) is int and 0 <= r < num_res else check(r) for r in path)
        if not rids:
            raise ValueError("flow path is empty: it must name at least one resource")
        if not 0.0 <= size_bytes < math.inf:
            raise ValueError(f"flow size_bytes={size_bytes!r} is invalid: must be finite, >= 0")
        if not isinstance(klass, TrafficClass):
            raise ValueError(f"flow klass={klass!r} is invalid: must be a TrafficClass")
        if not max_rate_bytes_per_s > 0.0:
            raise ValueError(
                f"flow max_rate_bytes_per_s={max_rate_bytes_per_s!r} is invalid: must be > 0"
            )
        fid = self._next_id
        self._next_id = fid + 1
        slot = self._alloc()
        now = self._loop.now
        self._f_id[slot] = fid
        self._f_cls[slot] = int(klass)
        self._f_size[slot] = float(size_bytes)
        self._f_rem[slot] = float(size_bytes)
        self._f_t[slot] = now
        self._f_rate[slot] = -1.0  # not yet rated: forces a finish-heap entry at settle
        self._f_cap[slot] = float(max_rate_bytes_per_s)
        if max_rate_bytes_per_s < math.inf:
            self._num_capped += 1
        self._f_done[slot] = on_done
        self._slot_of[fid] = slot
        if size_bytes == 0.0:
            self._f_path[slot] = ()
            self._f_ver[slot] += 1
            heapq.heappush(self._finish, (now, fid, slot, self._f_ver[slot]))
            self._arm()
            return fid
        self._f_path[slot] = rids
        k = int(klass) if self._tm else 0
        members, tot = self._members[k], self._tot[k]
        for r in rids:
            m = members[r]
            m[slot] = m.get(slot, 0) + 1
            tot[r] += 1
        cap = self._f_cap[slot]
        if cap < math.inf and self._unsaturated(slot, rids, cap, True):
            self._f_rate[slot] = cap
            self._f_ver[slot] += 1
            heapq.heappush(
                self._finish, (now + self._f_size[slot] / cap, fid, slot, self._f_ver[slot])
            )
            self._shift_rates(rids, cap)
        else:
            self._new.append(slot)
            if cap == math.inf:  # it saturates a resource: walk through the likeliest one
                c, rate = self._cap, self._rate
                tight = min(rids, key=lambda r: (c[r] - rate[r]) / rids.count(r))
                self._forced[tight] = None
            self._mark_dirty(rids, k == 0 and self._tm)
        return fid

    def cancel_flow(self, flow_id: int) -> float:
        """Stop a flow without calling ``on_done``; returns the bytes it had left (0.0 if it
        already finished or was cancelled)."""
        slot = self._slot(flow_id)
        if slot < 0:
            return 0.0
        left = self._remaining(slot, self._loop.now)
        self._detach(slot)
        self._release(slot)
        return left

    def rate_bytes_per_s(self, flow_id: int) -> float:
        """Current rate of a flow (0.0 once it finished or was cancelled)."""
        slot = self._slot(flow_id)
        if slot < 0:
            return 0.0
        self._settle()
        return max(self._f_rate[slot], 0.0)

    def remaining_bytes(self, flow_id: int) -> float:
        slot = self._slot(flow_id)
        return 0.0 if slot < 0 else self._remaining(slot, self._loop.now)

    @property
    def num_active_flows(self) -> int:
        return len(self._slot_of)

    @property
    def num_settles(self) -> int:
        """Rate recomputations so far (at most one per instant unless queries force more)."""
        return self._num_settles

    @property
    def num_settled_flows(self) -> int:
        """Sum over recomputations of the flows re-rated (mean component size × settles)."""
        return self._num_settled_flows

    def _slot(self, flow_id: int) -> int:
        fid = operator.index(flow_id)
        if not 0 <= fid < self._next_id:
            raise ValueError(f"flow_id={flow_id!r} is invalid: no such flow")
        return self._slot_of.get(fid, -1)

    def _remaining(self, slot: int, now: float) -> float:
        left = self._f_rem[slot] - max(self._f_rate[slot], 0.0) * (now - self._f_t[slot])
        return left if left > 0.0 else 0.0

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        for lst in (self._f_id, self._f_cls, self._f_ver, self._f_mark):
            lst.append(-1)
        for vals in (self._f_size, self._f_rem, self._f_t, self._f_rate, self._f_cap):
            vals.append(0.0)
        self._f_new.append(0.0)
        self._f_path.append(())
        self._f_done.append(None)
        return len(self._f_id) - 1

    def _detach(self, slot: int) -> None:
        path = self._f_path[slot]
        k = self._f_cls[slot] if self._tm else 0
        members, tot = self._members[k], self._tot[k]
        for r in path:
            tot[r] -= members[r].pop(slot, 0)
        x = self._f_rate[slot]
        if not path:
            return
        if x >= 0.0 and self._unsaturated(slot, path, 0.0, False):
            self._shift_rates(path, -x)
        else:
            if x > 0.0:
                gone = self._gone
                for r in path:
                    gone[r] = gone.get(r, 0.0) + x
            self._mark_dirty(path, k == 0 and self._tm)

    def _release(self, slot: int) -> None:
        del self._slot_of[self._f_id[slot]]
        if self._f_cap[slot] < math.inf:
            self._num_capped -= 1
        self._f_ver[slot] += 1
        self._f_done[slot] = None
        self._f_path[slot] = ()
        self._free.append(slot)

    # -- recomputation ---------------------------------------------------------------------

    def _unsaturated(
        self, slot: int, path: tuple[int, ...], add_rate: float, starting: bool
    ) -> bool:
        """Whether every resource of ``path``, carrying ``add_rate`` more per crossing, stays
        clearly below its HIGH share. Then it is a bottleneck neither before nor after a flow
        that crosses only such resources (and, when starting, runs at its cap ``add_rate``)
        starts or ends: every other flow's progressive filling runs the same operations on
        its bottlenecks, so its rate is exactly what a recomputation would give. With the
        traffic manager, only for a LOW flow that leaves every resource's ``_shared`` as it
        was (HIGH fills on shares that depend on it; ``_settle_high``)."""
        cap, rate, lim = self._cap, self._rate, self._slack_limit
        if not all(rate[r] + add_rate * path.count(r) <= cap[r] * lim for r in path):
            return False
        if not self._tm:
            return True
        if not self._f_cls[slot]:
            return False
        t0, t1 = self._tot
        if starting:  # the flow is counted already
            return all(not t0[r] or t1[r] > path.count(r) for r in path)
        return all(not t0[r] or t1[r] for r in path)

    def _shift_rates(self, path: tuple[int, ...], delta: float) -> None:
        """A flow at rate ``|delta|`` started (+) or ended (-) without a recomputation:
        account resources at their old rates, then adjust them."""
        self._account(list(path), self._loop.now)
        rate, t0, t1 = self._rate, *self._tot
        for r in path:
            left = rate[r] + delta
            rate[r] = left if left > 0.0 and (t0[r] or t1[r]) else 0.0
        self._rearm = True
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
        if self._settle_ev is None:
            self._settle_ev = self._loop.at(
                self._loop.now, self._settle, SETTLE_PRIORITY, "net.settle"
            )

    def _settle(self) -> None:
        """Recompute rates of every flow in the components of the dirty resources."""
        event = self._settle_ev
        if event is not None:
            self._settle_ev = None
            self._loop.cancel(event)  # a no-op when it is the event running now
        if not self._dirty:
            if self._rearm:
                self._rearm = False
                self._arm()
            return
        self._rearm = False
        self._num_settles += 1
        now = self._loop.now
        dirty = list(self._dirty)
        self._dirty = {}
        forced = self._forced
        self._forced = {}
        high_flows: list[int] = []
        if self._local and self._tm:
            high_flows = self._settle_high(dirty, forced)  # may add to dirty and forced
        if self._local:
            res, edge, flows, pinned = self._component(dirty, True, forced)
            self._account(res, now)
            self._account(edge, now)
        ok = self._local and self._assign_rates(res, edge, flows, pinned, self._tm)
        self._new.clear()
        self._gone.clear()
        if ok:
            flows = high_flows + flows
        else:
            self._num_fallbacks += self._local
            res, edge, flows, pinned = self._component(dirty, False, forced)
            self._account(res, now)
            self._assign_rates(res, edge, flows, pinned, False)
        self._num_settled_flows += len(flows)
        self._reschedule(flows, now)
        self._arm()

    def _settle_high(self, dirty: list[int], forced: dict[int, None]) -> list[int]:
        """Traffic manager: refill HIGH over the HIGH flows connected to resources where a
        HIGH flow started or ended or ``_shared`` flipped (HIGH rates depend on nothing
        else). Resources where what HIGH leaves changed are added to ``dirty`` and
        ``forced`` (LOW refills there). Returns the HIGH flows re-rated (rates in
        ``_f_new``)."""
        t0, t1 = self._tot
        shared, dirty_high = self._shared, self._dirty_high
        start = [r for r in dirty if r in dirty_high or bool(t0[r] and t1[r]) is not shared[r]]
        self._dirty_high = {}
        if not start:
            return []
        self._epoch += 1
        epoch = self._epoch
        rmark, fmark, paths, m0 = self._rmark, self._f_mark, self._f_path, self._members[0]
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
        cap, avail, cnt, left = self._cap, self._scratch, self._cnt, self._high_left
        high_share = 1.0 - self._floor
        for r in res:
            avail[r] = cap[r] * high_share if t0[r] and t1[r] else cap[r]
            cnt[r] = t0[r]
        fill_max_min(flows, self._capped(flows), m0, res, paths, self._f_new, avail, cnt)
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

    def _component(
        self, dirty: list[int], local: bool, forced: dict[int, None]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The flows whose rates a change on the dirty resources can move, and the resources
        they cross: ``(res, edge, flows, pinned)``.

        Walks breadth-first from the dirty resources through shared resources. With
        ``local``, the walk does not pass through a resource that is clearly unsaturated
        (below ``_slack_limit`` of capacity at its settled rate), unless ``forced`` (an
        uncapped flow started there, or what HIGH leaves there changed): such a resource is
        no flow's bottleneck, so it couples nobody's rate. It is returned in ``edge`` (its
        other flows keep their rates); flows that started are taken in directly. Capped flows
        running at their cap on clearly unsaturated resources are not re-rated either
        (``pinned``). ``_assign_rates`` checks after filling that every edge resource (and
        every pinned flow's resource) is still clearly unsaturated; if one is not, the settle
        is redone without ``local``, over the whole connected component. When the check
        passes, the result is what progressive filling over the whole component gives, bit
        for bit: the filling of flows coupled only through never-saturating resources runs
        the same operations, in the same (level, resource id) order, together or apart.
        """
        self._epoch += 1
        epoch = self._epoch
        rmark, fmark, paths = self._rmark, self._f_mark, self._f_path
        fcap, frate = self._f_cap, self._f_rate
        cap, rate, lim = self._cap, self._rate, self._slack_limit
        flows: list[int] = []
        pinned: list[int] = []
        edge: list[int] = []
        res: list[int] = []
        for r in dirty:
            rmark[r] = epoch
            if not local or r in forced or rate[r] > cap[r] * lim:
                res.append(r)
            else:
                edge.append(r)  # a guess; _assign_rates checks after
        if local:
            cls, tm = self._f_cls, self._tm
            for s in self._new:  # their resources are all dirty, so marked already
                if fmark[s] != epoch and paths[s] and frate[s] == -1.0 and (cls[s] or not tm):
                    fmark[s] = epoch
                    flows.append(s)
        pin = local and self._num_capped > 0
        m0, m1 = self._members
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
                                if rate[r2] > cap[r2] * lim:
                                    break
                            else:
                                add_pinned(s)
                                continue
                        add_flow(s)
                        for r2 in paths[s]:
                            if rmark[r2] != epoch:
                                rmark[r2] = epoch
                                if local and rate[r2] <= cap[r2] * lim:
                                    add_edge(r2)  # a guess; _assign_rates checks after
                                else:
                                    add_res(r2)
        return res, edge, flows, pinned

    def _account(self, res: list[int], now: float) -> None:
        last, busy, rate, carried = self._last_s, self._busy_s, self._rate, self._carried
        for r in res:
            dt = now - last[r]
            if dt > 0.0:
                x = rate[r]
                if x > 0.0:
                    carried[r] += x * dt
                    busy[r] += dt
                last[r] = now

    def _assign_rates(
        self, res: list[int], edge: list[int], flows: list[int], pinned: list[int], low: bool
    ) -> bool:
        """New rates into ``_f_new``; resource rate sums = capacity minus what is left (for
        ``edge`` resources: old sum plus the changes). Pinned flows keep their rate. ``low``
        (traffic manager): ``flows`` are LOW, filled on what HIGH left (``_settle_high``);
        else both classes, HIGH first. False, changing no settled rate, if an edge resource
        or a pinned flow's resource is no longer clearly unsaturated (then redo over the
        whole component)."""
        cap, avail, new, rate, cnt = self._cap, self._scratch, self._f_new, self._rate, self._cnt
        m0, m1 = self._members
        t0, t1 = self._tot
        paths, cls = self._f_path, self._f_cls
        inf = math.inf
        for r in edge:  # never a bottleneck here: filling only passes through
            avail[r] = inf
        high_share = 1.0 - self._floor
        high_left, shared = self._high_left, self._shared
        if low:
            for r in res:  # what HIGH left, plus the floor HIGH could not take
                left = high_left[r] + (cap[r] - cap[r] * high_share if shared[r] else 0.0)
                avail[r] = left if left > 0.0 else 0.0
                cnt[r] = t1[r]
            self._pin(pinned)
            fill_max_min(flows, self._capped(flows), m1, res, paths, new, avail, cnt)
        elif not self._tm:  # one class
            for r in res:
                avail[r] = cap[r]
                cnt[r] = t0[r]
            self._pin(pinned)
            fill_max_min(flows, self._capped(flows), m0, res, paths, new, avail, cnt)
        else:
            high = [s for s in flows if not cls[s]]
            for r in res:
                avail[r] = cap[r] * high_share if t0[r] and t1[r] else cap[r]
                cnt[r] = t0[r]
            self._pin([s for s in pinned if not cls[s]])
            fill_max_min(high, self._capped(high), m0, res, paths, new, avail, cnt)
            for r in res:  # LOW: what HIGH left, plus the floor HIGH could not take
                both = bool(t0[r] and t1[r])
                high_left[r] = avail[r]
                shared[r] = both
                left = avail[r] + (cap[r] - cap[r] * high_share if both else 0.0)
                avail[r] = left if left > 0.0 else 0.0
                cnt[r] = t1[r]
            self._pin([s for s in pinned if cls[s]])
            low_flows = [s for s in flows if cls[s]]
            fill_max_min(low_flows, self._capped(low_flows), m1, res, paths, new, avail, cnt)
        lim = self._slack_limit
        edge_rate: dict[int, float] = {}
        if edge:
            frate, paths = self._f_rate, self._f_path
            gone = self._gone  # what flows that ended took (dirty edge resources)
            edge_rate = {r: rate[r] - gone.get(r, 0.0) for r in edge}
            for s in flows:
                old = frate[s]
                delta = new[s] - (old if old > 0.0 else 0.0)
                if delta != 0.0:
                    for r in paths[s]:
                        if r in edge_rate:
                            edge_rate[r] += delta
            for r, x in edge_rate.items():
                if x > cap[r] * lim:
                    return False
        for r in res:
            used = cap[r] - avail[r]
            rate[r] = used if used > 0.0 else 0.0
        for r, x in edge_rate.items():
            rate[r] = x if x > 0.0 and (t0[r] or t1[r]) else 0.0
        paths = self._f_path
        for s in pinned:
            for r in paths[s]:
                if rate[r] > cap[r] * lim:
                    return False
        return True

    def _capped(self, flows: list[int]) -> list[tuple[float, int, int]]:
        """``(rate cap, flow id, slot)`` of the capped ones among ``flows``, sorted."""
        if not self._num_capped:
            return []
        fcap, fid = self._f_cap, self._f_id
        return sorted([(fcap[s], fid[s], s) for s in flows if fcap[s] < math.inf])

    def _pin(self, pinned: list[int]) -> None:
        """Freeze pinned flows at their rate (so no bottleneck re-freezes them) and take
        that rate off the resources being recomputed, before filling."""
        avail, cnt, rmark, epoch = self._scratch, self._cnt, self._rmark, self._epoch
        rate, new, paths = self._f_rate, self._f_new, self._f_path
        for s in pinned:
            x = rate[s]
            new[s] = x
            for r in paths[s]:
                if rmark[r] == epoch:
                    avail[r] -= x
                    cnt[r] -= 1

    def _reschedule(self, flows: list[int], now: float) -> None:
        """Flows whose rate changed: bring remaining bytes to ``now`` at the old rate and
        push a new finish entry. Unchanged flows keep their (still exact) entry."""
        new, rate, rem, ft, ver = self._f_new, self._f_rate, self._f_rem, self._f_t, self._f_ver
        fids, fin, push = self._f_id, self._finish, heapq.heappush
        for s in flows:
            x = new[s]
            old = rate[s]
            if x == old:
                continue
            if old > 0.0:
                left = rem[s] - old * (now - ft[s])
                rem[s] = left if left > 0.0 else 0.0
            ft[s] = now
            rate[s] = x
            v = ver[s] + 1
            ver[s] = v
            if x > 0.0:
                push(fin, (now + rem[s] / x, fids[s], s, v))
        if len(fin) > 4 * len(self._slot_of) + 1024:  # drop stale entries now and then
            fin[:] = [e for e in fin if ver[e[2]] == e[3]]
            heapq.heapify(fin)

    def _arm(self) -> None:
        """Keep one loop event at the earliest pending finish time."""
        fin, ver = self._finish, self._f_ver
        while fin and ver[fin[0][2]] != fin[0][3]:
            heapq.heappop(fin)
        if not fin:
            if self._timer is not None:
                self._loop.cancel(self._timer)
                self._timer = None
            return
        t = max(fin[0][0], self._loop.now)
        if self._timer is not None:
            if self._timer_s == t:
                return
            self._loop.cancel(self._timer)
        self._timer = self._loop.at(t, self._on_timer, self._priority, "net.done")
        self._timer_s = t

    def _on_timer(self) -> None:
        self._timer = None
        now = self._loop.now
        fin, ver, size = self._finish, self._f_ver, self._f_size
        done: list[Callable[[], object]] = []
        while fin:
            t, _, s, v = fin[0]
            if ver[s] != v:
                heapq.heappop(fin)
                continue
            if t > now and self._remaining(s, now) > DONE_REL * size[s]:
                break
            heapq.heappop(fin)
            callback = self._f_done[s]
            if callback is not None:  # always, for a live entry
                done.append(callback)
            self._detach(s)
            self._release(s)
        for callback in done:
            callback()
        self._settle()
        self._arm()
