"""Fluid network: flows over paths of capacity resources at max-min fair rates (design §6).

The public face of the network: resources (capacity, bytes carried, busy time) and flows
(start, cancel, remaining bytes, completion). Rates change only when a flow starts or ends
and are recomputed by the rate component (``rates/``) only where they can change; the
shared table of resources and flows is ``flowtable.py``. Knows nothing of engines, KV
blocks or policies.
"""

from __future__ import annotations

import bisect
import heapq
import math
import operator
from collections.abc import Callable, Sequence

from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.flowtable import FlowTable
from dualpath.sim.rates import RateSolver
from dualpath.types import TrafficClass

__all__ = ["DONE_REL", "FluidNetwork"]

DONE_REL = 1e-9  # a flow is done once remaining <= DONE_REL * size


class FluidNetwork:
    """Resources with capacities (bytes/s) shared by flows, each a path of resources.

    Rates: max-min fair by progressive filling; a per-flow ``max_rate_bytes_per_s`` acts as a
    private link. With ``traffic_manager`` (design §6, work-conserving WRR), on every resource
    that carries both classes HIGH may use at most ``(1 - low_floor)`` of capacity; HIGH is
    filled first (max-min among HIGH), then LOW max-min on what is left, so LOW gets at least
    ``low_floor`` of such a resource plus whatever HIGH leaves idle. (Approximation: HIGH is
    held to its share even when the LOW flows there are bottlenecked below ``low_floor``.)
    Without it, one class, plain max-min on full capacities. A resource listed k times in a
    path carries that flow k times (e.g. half-duplex DRAM read and written by one transfer).

    Timing: starts, cancels and completions mark resources dirty; rates are recomputed once
    per instant (a loop event at ``Priority.SETTLE``, or earlier on any query), which is exact
    since no time passes in between, and only where they can change (``rates``, a
    ``RateSolver``: results bit-identical to refilling whole components, which
    ``local_rates=False`` does instead, as a reference for tests). Completions are fired by
    one loop event (``priority``, label ``net.done``); flows finishing at the same instant
    get ``on_done()`` in order of (finish time, flow id). Zero-size flows complete at ``now``
    through the loop too.

    State: resources and flows live in a ``FlowTable`` shared with the rate solver; this
    class owns the flows' timing (remaining bytes, the finish heap, the completion timer),
    resource names and per-class byte counters.
    """

    def __init__(
        self,
        loop: EventLoop,
        traffic_manager: bool = True,
        low_floor: float = 0.01,
        priority: int = Priority.COMPLETION,
        local_rates: bool = True,
    ) -> None:
        if not 0.0 <= low_floor < 1.0:
            raise ValueError(f"low_floor={low_floor!r} is invalid: must be in [0, 1)")
        self._loop = loop
        self._tm = bool(traffic_manager)
        self._priority = priority
        self._names: dict[str, int] = {}
        self._class_bytes: tuple[list[float], list[float]] = ([], [])  # by flow, per class
        self._t = FlowTable()
        self.rates = RateSolver(
            loop,
            self._t,
            traffic_manager=self._tm,
            low_floor=float(low_floor),
            reschedule=self._reschedule,
            arm=self._arm,
            local=local_rates,
        )
        self._free: list[int] = []  # flow slots to reuse
        self._next_id = 0
        self._finish: list[tuple[float, int, int, int]] = []  # (finish_s, flow id, slot, ver)
        self._timer: Event | None = None
        self._timer_s = math.nan

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
        capacity = float(capacity_bytes_per_s)
        rid = self._t.add_resource(capacity, self._loop.now)
        self.rates.add_resource(capacity)
        self._names[name] = rid
        for per_class in self._class_bytes:
            per_class.append(0.0)
        return rid

    @property
    def num_resources(self) -> int:
        return len(self._t.cap)

    def resource_id(self, name: str) -> int:
        if name not in self._names:
            raise ValueError(f"unknown resource name {name!r}")
        return self._names[name]

    def capacity(self, resource_id: int) -> float:
        """Capacity in bytes/s."""
        return self._t.cap[self._check_rid(resource_id)]

    def bytes_carried(self, resource_id: int) -> float:
        """Bytes the resource has carried up to ``now`` (a flow crossing it k times counts k
        times)."""
        r = self._check_rid(resource_id)
        self.rates.settle()
        return self._t.carried[r] + self._t.rate[r] * (self._loop.now - self._t.last_s[r])

    def busy_time_s(self, resource_id: int) -> float:
        """Seconds up to ``now`` during which the resource carried a positive rate."""
        r = self._check_rid(resource_id)
        self.rates.settle()
        busy = self._t.rate[r] > 0.0
        return self._t.busy_s[r] + (self._loop.now - self._t.last_s[r] if busy else 0.0)

    def bytes_carried_by_class(self, resource_id: int, klass: TrafficClass) -> float:
        """Bytes of ``klass`` flows the resource has carried up to ``now`` (counted per flow:
        finished and cancelled flows' moved bytes plus live flows' progress). The classes
        add up to ``bytes_carried`` up to rounding."""
        r = self._check_rid(resource_id)
        if not isinstance(klass, TrafficClass):
            raise ValueError(f"klass={klass!r} is invalid: must be a TrafficClass")
        self.rates.settle()
        k, now = int(klass), self._loop.now
        members = self._t.members[k if self._tm else 0][r]
        live = sum(
            (self._t.f_size[s] - self._remaining(s, now)) * m
            for s, m in members.items()
            if self._t.f_cls[s] == k
        )
        return self._class_bytes[k][r] + live

    def _count_moved(self, slot: int, moved: float) -> None:
        """A flow leaves having moved ``moved`` bytes: add them to its class's counters."""
        per_class = self._class_bytes[self._t.f_cls[slot]]
        for r in self._t.f_path[slot]:
            per_class[r] += moved

    def _check_rid(self, resource_id: int) -> int:
        r = operator.index(resource_id)
        if not 0 <= r < len(self._t.cap):
            raise ValueError(f"resource_id={resource_id!r} is invalid: have {len(self._t.cap)}")
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
        num_res = len(self._t.cap)
        rids = tuple(path)
        for r in rids:  # plain loop: this runs at every flow start
            if type(r) is not int or not 0 <= r < num_res:
                rids = tuple(map(self._check_rid, rids))
                break
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
        t = self._t
        kc = int(klass)
        size = float(size_bytes)
        t.f_id[slot] = fid
        t.f_cls[slot] = kc
        t.f_size[slot] = size
        t.f_rem[slot] = size
        t.f_t[slot] = now
        t.f_rate[slot] = -1.0  # not yet rated: forces a finish-heap entry at settle
        cap = t.f_cap[slot] = float(max_rate_bytes_per_s)
        if cap < math.inf:
            t.num_capped += 1
            key = t.f_key[slot] = (cap, fid, slot)
            bisect.insort(t.capped, key)
        t.f_done[slot] = on_done
        t.slot_of[fid] = slot
        if size == 0.0:
            t.f_path[slot] = ()
            ver = t.f_ver[slot] = t.f_ver[slot] + 1
            heapq.heappush(self._finish, (now, fid, slot, ver))
            self._arm()
            return fid
        t.f_path[slot] = rids
        k = kc if self._tm else 0
        members, tot = t.members[k], t.tot[k]
        for r in rids:
            m = members[r]
            m[slot] = m.get(slot, 0) + 1
            tot[r] += 1
        rates = self.rates
        if cap < math.inf and rates.unsaturated(slot, rids, cap, True):
            t.f_rate[slot] = cap
            ver = t.f_ver[slot] = t.f_ver[slot] + 1
            heapq.heappush(self._finish, (now + size / cap, fid, slot, ver))
            rates.shift_rates(rids, cap)
        else:
            rates.started(slot, rids, k == 0 and self._tm)
        return fid

    def cancel_flow(self, flow_id: int) -> float:
        """Stop a flow without calling ``on_done``; returns the bytes it had left (0.0 if it
        already finished or was cancelled)."""
        slot = self._slot(flow_id)
        if slot < 0:
            return 0.0
        left = self._remaining(slot, self._loop.now)
        self._count_moved(slot, self._t.f_size[slot] - left)
        self._detach(slot)
        self._release(slot)
        return left

    def rate_bytes_per_s(self, flow_id: int) -> float:
        """Current rate of a flow (0.0 once it finished or was cancelled)."""
        slot = self._slot(flow_id)
        if slot < 0:
            return 0.0
        self.rates.settle()
        return max(self._t.f_rate[slot], 0.0)

    def remaining_bytes(self, flow_id: int) -> float:
        slot = self._slot(flow_id)
        return 0.0 if slot < 0 else self._remaining(slot, self._loop.now)

    @property
    def num_active_flows(self) -> int:
        return len(self._t.slot_of)

    @property
    def num_settles(self) -> int:
        """Rate recomputations so far (at most one per instant unless queries force more)."""
        return self.rates.num_settles

    @property
    def num_settled_flows(self) -> int:
        """Sum over recomputations of the flows re-rated (mean component size × settles)."""
        return self.rates.num_settled_flows

    def _slot(self, flow_id: int) -> int:
        fid = operator.index(flow_id)
        if not 0 <= fid < self._next_id:
            raise ValueError(f"flow_id={flow_id!r} is invalid: no such flow")
        return self._t.slot_of.get(fid, -1)

    def _remaining(self, slot: int, now: float) -> float:
        t = self._t
        left = t.f_rem[slot] - max(t.f_rate[slot], 0.0) * (now - t.f_t[slot])
        return left if left > 0.0 else 0.0

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        self.rates.add_slot()
        return self._t.add_slot()

    def _detach(self, slot: int) -> None:
        t = self._t
        path = t.f_path[slot]
        k = t.f_cls[slot] if self._tm else 0
        members, tot = t.members[k], t.tot[k]
        for r in path:
            tot[r] -= members[r].pop(slot, 0)
        x = t.f_rate[slot]
        if not path:
            return
        if x >= 0.0 and self.rates.unsaturated(slot, path, 0.0, False):
            self.rates.shift_rates(path, -x)
        else:
            self.rates.ended(path, x, k)

    def _release(self, slot: int) -> None:
        t = self._t
        del t.slot_of[t.f_id[slot]]
        if t.f_cap[slot] < math.inf:
            t.num_capped -= 1
            key = t.f_key[slot]
            if key is not None:  # always, for a live capped flow
                del t.capped[bisect.bisect_left(t.capped, key)]
            t.f_key[slot] = None
        t.f_ver[slot] += 1
        t.f_done[slot] = None
        t.f_path[slot] = ()
        self._free.append(slot)

    def _arm(self) -> None:
        """Keep one loop event at the earliest pending finish time."""
        fin, ver = self._finish, self._t.f_ver
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
        fin, ver, size = self._finish, self._t.f_ver, self._t.f_size
        cls, paths = self._t.f_cls, self._t.f_path
        done: list[Callable[[], object]] = []
        rates = self.rates
        rates.deferred = True  # settled below, after the callbacks: no settle event
        try:
            while fin:
                t, _, s, v = fin[0]
                if ver[s] != v:
                    heapq.heappop(fin)
                    continue
                if t > now and self._remaining(s, now) > DONE_REL * size[s]:
                    break
                heapq.heappop(fin)
                callback = self._t.f_done[s]
                if callback is not None:  # always, for a live entry
                    done.append(callback)
                moved, per_class = size[s], self._class_bytes[cls[s]]  # _count_moved, inlined
                for r in paths[s]:
                    per_class[r] += moved
                self._detach(s)
                self._release(s)
            for callback in done:
                callback()
        finally:
            rates.deferred = False
        if not rates.settle():  # it arms the timer when a flow changed
            self._arm()

    def _reschedule(self, flows: list[int], now: float) -> None:
        """The rate solver re-rated ``flows`` (new rates in ``rates.new``). Those whose rate
        changed: bring remaining bytes to ``now`` at the old rate and push a new finish entry.
        Unchanged flows keep their (still exact) entry."""
        t = self._t
        new, rate, rem, ft, ver = self.rates.new, t.f_rate, t.f_rem, t.f_t, t.f_ver
        fids, fin, push = t.f_id, self._finish, heapq.heappush
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
        if len(fin) > 4 * len(t.slot_of) + 1024:  # drop stale entries now and then
            fin[:] = [e for e in fin if ver[e[2]] == e[3]]
            heapq.heapify(fin)
