"""The resources and flows of one fluid network as parallel lists (design §6).

A plain table, no behaviour beyond growing and time accounting: ``FluidNetwork``
(``network.py``) adds resources and flows and owns their timing (remaining bytes, finish
times, completions); ``RateSolver`` (``rates/``) reads paths, classes and caps and writes
the rates. Resources are indexed by resource id, flows by slot (slots are reused, flow ids
are not). Who writes what:

- ``FluidNetwork``: ``cap``, ``members``, ``tot``, every ``f_*`` list except ``f_rate`` of a
  flow being re-rated, ``slot_of``, ``num_capped``, ``capped``.
- ``RateSolver``: ``rate`` (the settled total rate through each resource), and, through
  ``account``, ``carried`` / ``busy_s`` / ``last_s`` just before a resource's rate changes.
"""

from __future__ import annotations

from collections.abc import Callable


class FlowTable:
    """Resources (capacity, flows crossing them per class, settled rate, bytes carried and
    busy time up to ``last_s``) and flows (id, path, class, size, remaining bytes at time
    ``f_t``, rate, rate cap, completion callback, finish-entry version)."""

    __slots__ = (
        "busy_s",
        "cap",
        "capped",
        "carried",
        "f_cap",
        "f_cls",
        "f_done",
        "f_id",
        "f_key",
        "f_path",
        "f_rate",
        "f_rem",
        "f_size",
        "f_t",
        "f_ver",
        "last_s",
        "members",
        "num_capped",
        "rate",
        "slot_of",
        "tot",
    )

    def __init__(self) -> None:
        # resources
        self.cap: list[float] = []
        # per class (LOW uses index 1 only under the traffic manager): slot -> multiplicity
        self.members: tuple[list[dict[int, int]], list[dict[int, int]]] = ([], [])
        self.tot: tuple[list[int], list[int]] = ([], [])  # sum of multiplicities in members
        self.rate: list[float] = []
        self.carried: list[float] = []
        self.last_s: list[float] = []
        self.busy_s: list[float] = []
        # flows
        self.f_id: list[int] = []
        self.f_path: list[tuple[int, ...]] = []
        self.f_cls: list[int] = []
        self.f_size: list[float] = []
        self.f_rem: list[float] = []  # remaining bytes at time f_t
        self.f_t: list[float] = []
        self.f_rate: list[float] = []  # -1.0: not yet rated
        self.f_cap: list[float] = []
        # (rate cap, flow id, slot) of a live capped flow, None otherwise: its place in the
        # order capped flows freeze in (``rates/capped.py``), built once per flow
        self.f_key: list[tuple[float, int, int] | None] = []
        self.capped: list[tuple[float, int, int]] = []  # every live capped flow's key, sorted
        self.f_done: list[Callable[[], object] | None] = []
        self.f_ver: list[int] = []  # bumps invalidate finish-heap entries
        self.slot_of: dict[int, int] = {}  # live flow id -> slot
        self.num_capped = 0  # live flows with a finite rate cap

    def add_resource(self, capacity: float, now: float) -> int:
        rid = len(self.cap)
        self.cap.append(capacity)
        for per_class in self.members:
            per_class.append({})
        for tot in self.tot:
            tot.append(0)
        self.rate.append(0.0)
        self.carried.append(0.0)
        self.last_s.append(now)
        self.busy_s.append(0.0)
        return rid

    def add_slot(self) -> int:
        for ints in (self.f_id, self.f_cls, self.f_ver):
            ints.append(-1)
        for vals in (self.f_size, self.f_rem, self.f_t, self.f_rate, self.f_cap):
            vals.append(0.0)
        self.f_path.append(())
        self.f_done.append(None)
        self.f_key.append(None)
        return len(self.f_id) - 1

    def account(self, res: list[int], edge: list[int], now: float) -> None:
        """Bring the bytes carried and busy time of ``res``, then of ``edge``, up to ``now`` at
        their current rates (call before changing a rate; one call per settle)."""
        last, busy, rate, carried = self.last_s, self.busy_s, self.rate, self.carried
        for group in (res, edge):
            for r in group:
                dt = now - last[r]
                if dt > 0.0:
                    x = rate[r]
                    if x > 0.0:
                        carried[r] += x * dt
                        busy[r] += dt
                    last[r] = now
