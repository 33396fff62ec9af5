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

from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.rates import SLACK_REL, RateSolver
from dualpath.types import TrafficClass

__all__ = ["DONE_REL", "FluidNetwork"]

DONE_REL = 1e-9  # a flow is done once remaining <= DONE_REL * size


class FluidNetwork(RateSolver):
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
    per instant (a loop event at ``Priority.SETTLE``, or earlier on any query), which is exact
    since no time passes in between, and only where they can change (``RateSolver``, in
    ``rates.py``: results bit-identical to refilling whole components). Completions are fired by one loop event (``priority``, label ``net.done``); flows
    finishing at the same instant get ``on_done()`` in order of (finish time, flow id).
    Zero-size flows complete at ``now`` through the loop too.
    """

    def __init__(
        self,
        loop: EventLoop,
        traffic_manager: bool = True,
        low_floor: float = 0.01,
        priority: int = Priority.COMPLETION,
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
        self._class_bytes: tuple[list[float], list[float]] = ([], [])  # by flow, per class
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
        for per_class in self._class_bytes:
            per_class.append(0.0)
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

    def bytes_carried_by_class(self, resource_id: int, klass: TrafficClass) -> float:
        """Bytes of ``klass`` flows the resource has carried up to ``now`` (counted per flow:
        finished and cancelled flows' moved bytes plus live flows' progress). The classes
        add up to ``bytes_carried`` up to rounding."""
        r = self._check_rid(resource_id)
        if not isinstance(klass, TrafficClass):
            raise ValueError(f"klass={klass!r} is invalid: must be a TrafficClass")
        self._settle()
        k, now = int(klass), self._loop.now
        members = self._members[k if self._tm else 0][r]
        live = sum(
            (self._f_size[s] - self._remaining(s, now)) * m
            for s, m in members.items()
            if self._f_cls[s] == k
        )
        return self._class_bytes[k][r] + live

    def _count_moved(self, slot: int, moved: float) -> None:
        """A flow leaves having moved ``moved`` bytes: add them to its class's counters."""
        per_class = self._class_bytes[self._f_cls[slot]]
        for r in self._f_path[slot]:
            per_class[r] += moved

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
        self._count_moved(slot, self._f_size[slot] - left)
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
            if x > 0.0 and (k or not self._tm):  # HIGH changes reach LOW via _high_left
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
            self._count_moved(s, size[s])
            self._detach(s)
            self._release(s)
        for callback in done:
            callback()
        self._settle()
        self._arm()
