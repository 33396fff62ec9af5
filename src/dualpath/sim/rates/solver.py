"""Rate recomputation of the fluid network (design §6): which flows a start or an end can move,
and their new max-min rates.

``RateSolver`` is the network's rate component and its one entry point. It reads the flows'
paths, classes and caps from the shared ``FlowTable``, writes the resources' settled rates
there (through its fill), and hands the flows it re-rated (new rates in ``new``) back to the
network, which owns their timing. Its parts own their state and never call it: the dirty set
(``dirty.py``), the walk from it (``walk.py``), the HIGH refill (``high.py``) and the
incremental fill (``fill.py``); ``settle`` hands one's result to the next.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.flowtable import FlowTable
from dualpath.sim.rates.dirty import DirtySet
from dualpath.sim.rates.fill import IncrementalFill
from dualpath.sim.rates.high import HighShares
from dualpath.sim.rates.walk import Walk

MAX_RETRIES = 4  # local refills with more resources walked through before a whole-component one


class RateSolver:
    """Recomputes rates once per instant, only where they can change.

    A change (start, end, cancel) marks the resources of its path dirty (``started``,
    ``ended``). At the settle (a loop event at ``Priority.SETTLE``, or earlier on any query
    through ``settle``): HIGH (traffic manager) is refilled apart where a HIGH flow changed
    or a resource's shared status flipped (``HighShares.refill``); LOW (or the single class) is
    refilled over the flows reachable from the dirty resources through resources that can be
    bottlenecks (``Walk.component``, filled by ``IncrementalFill.assign``); capped flows
    at their cap on clearly unsaturated resources are held. Guesses are checked after
    filling; a failed one is filled again locally with the resources that failed walked
    through (up to ``MAX_RETRIES`` times), then over the whole component, so the result is
    bit-identical to refilling whole components every time (``local=False``, the reference
    that ``tests/sim/test_network.py`` compares with).

    Its own state: the settle event, whether a flow changed without a recomputation, and
    counters; the parts hold the rest (the dirty sets of this instant, the HIGH shares, the
    kept subtractions, scratch lists for filling and walking). ``unsaturated`` is the dirty
    set's (``DirtySet.unsaturated``), asked at every start and end. ``reschedule(flows,
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
        self.new: list[float] = []  # per flow slot: the new rates of the flows re-rated
        self._high = HighShares(table, low_floor=low_floor, new=self.new)
        self._fill = IncrementalFill(
            table,
            traffic_manager=traffic_manager,
            low_floor=low_floor,
            local=local,
            new=self.new,
            high_left=self._high.left,
            shared=self._high.shared,
        )
        self._dirty = DirtySet(
            table, traffic_manager=traffic_manager, low_floor=low_floor, local=local
        )
        self._walk = Walk(
            table,
            traffic_manager=traffic_manager,
            limit=self._dirty.limit,
            started=self._dirty.started_slots,
            gone=self._dirty.gone,
            kept=self._fill.kept,
            base=self._fill.base,
        )
        self.unsaturated = self._dirty.unsaturated  # no wrapper: it runs at every start and end
        self._settle_ev: Event | None = None
        # True while the network fires completions: it settles right after them itself, so
        # changes schedule no settle event (one that would only be cancelled unprocessed)
        self.deferred = False
        self._rearm = False  # a flow changed without a recomputation: re-arm at settle
        self.num_settles = 0  # recomputations (at most one per instant unless queried)
        self.num_settled_flows = 0  # sum over recomputations of the flows re-rated
        self.num_fallbacks = 0  # local settles redone over the whole component
        self.num_retries = 0  # local refills redone with more resources walked through

    @property
    def num_incremental(self) -> int:
        """Settles that kept a prefix (``Walk._walk_above``)."""
        return self._walk.num_incremental

    @property
    def num_whole(self) -> int:
        """Settles that could not (no kept subtractions, or float checks)."""
        return self._walk.num_whole

    def add_resource(self, capacity: float) -> None:
        self._dirty.add_resource(capacity)
        self._high.add_resource(capacity)
        self._walk.add_resource()
        self._fill.add_resource()

    def add_slot(self) -> None:
        self.new.append(0.0)
        self._high.add_slot()
        self._walk.add_slot()
        self._fill.add_slot()

    def started(self, slot: int, path: tuple[int, ...], high: bool) -> None:
        """A flow started that needs a recomputation (``high``: a HIGH flow, under the traffic
        manager)."""
        self._dirty.started(slot, path, high)
        if self._settle_ev is None and not self.deferred:
            self._schedule()

    def ended(self, path: tuple[int, ...], rate: float, klass: int) -> None:
        """A flow of class ``klass`` (0 for all without the traffic manager) running at
        ``rate`` left ``path`` and needs a recomputation."""
        self._dirty.ended(path, rate, klass)
        if self._settle_ev is None and not self.deferred:
            self._schedule()

    def shift_rates(self, path: tuple[int, ...], delta: float) -> None:
        """A flow at rate ``|delta|`` started (+) or ended (-) without a recomputation:
        account resources at their old rates, then adjust them (``IncrementalFill.shift``);
        the settle of this instant re-arms the completion timer."""
        self._fill.shift(path, delta, self._loop.now)
        self._rearm = True
        if self._settle_ev is None and not self.deferred:
            self._schedule()

    def _schedule(self) -> None:
        """The settle event of this instant, after every other event of it."""
        self._settle_ev = self._loop.at(self._loop.now, self.settle, Priority.SETTLE, "net.settle")

    def settle(self) -> bool:
        """Recompute rates of every flow in the components of the dirty resources. True when
        it re-armed the completion timer (``arm``), which it does whenever a flow changed."""
        event = self._settle_ev
        if event is not None:
            self._settle_ev = None
            self._loop.cancel(event)  # a no-op when it is the event running now
        taken = self._dirty.take()
        if taken is None:
            if self._rearm:
                self._rearm = False
                self._arm()
                return True
            return False
        dirty, forced, dirty_high, lowest = taken
        self._rearm = False
        self.num_settles += 1
        now = self._loop.now
        local, tm, account = self._local, self._tm, self.t.account
        walk, fill = self._walk, self._fill
        high_flows: list[int] = []
        if local and tm:  # may add to dirty and forced
            high_flows = self._high.refill(dirty, forced, dirty_high)
        ok = False
        if local:
            # resources to walk through (forced, and those of failed guesses below) pin no
            # flow either: their limit is -1 during this settle (any choice of them is exact)
            self._dirty.hold(forced)
            c = walk.component(dirty, True, forced, lowest)
            account(c.res, c.edge, now)
            ok = fill.assign(c, tm)
            if not ok:
                # a resource guessed unsaturated saturates: fill again, walking through it,
                # before a whole component
                for _ in range(MAX_RETRIES):
                    self.num_retries += 1
                    self._dirty.hold(fill.failed)
                    c = walk.component(dirty, True, forced, lowest)
                    account(c.res, c.edge, now)
                    ok = fill.assign(c, tm)
                    if ok:
                        break
        self._dirty.done()
        if ok:
            flows = high_flows + c.flows
        else:
            self.num_fallbacks += local
            c = walk.component(dirty, False, forced, lowest)
            account(c.res, [], now)
            fill.assign(c, False)
            flows = c.flows
        self.num_settled_flows += len(flows)
        self._reschedule(flows, now)
        self._arm()
        return True
