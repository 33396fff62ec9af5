"""DualPath's DE assignment (design §7.1): phase 1 across DE groups, phase 2 within a group.

Phase 2 keeps two lazily-invalidated heaps per pull so that each decision costs O(log n)
instead of a scan of the group, while choosing exactly what the literal rule chooses.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import islice

from dualpath.policy.decode import RUNNERS_UP, Held, Placed, hbm_tokens
from dualpath.policy.state import RoundState
from dualpath.policy.trace import DecisionTrace


class DualPathDecode:
    """Phase 1: each request of the DE queue moves to the private queue of the DE group with
    the smallest load = Σ tok_e + tokens already in its private queue (ties: lowest group id).
    Phase 2 (the pulling group): R = longest prefix of the private queue whose Σ len_r fits in
    the group's total free HBM; ``Z = z_factor · (Σ_R len_r + Σ_E tok_e) / |E|``. Pop the head
    r; DEs with ``free ≥ len_r`` are normal if ``tok_e + len_r ≤ Z``, else high-token. Choose
    the normal DE with the smallest (seq_e, tok_e, id), else the high-token DE with the
    smallest (tok_e, id). No DE with room ⇒ stop (r stays at the head)."""

    def __init__(self, z_factor: float) -> None:
        self.z_factor = z_factor
        self.private: dict[int, deque[Held]] = {}
        self.private_tokens: dict[int, int] = {}

    def queued_by_group(self) -> dict[int, int]:
        return {g: len(q) for g, q in sorted(self.private.items()) if q}

    def round(
        self,
        st: RoundState,
        queue: deque[Held],
        out: list[Placed],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        for gid in st.de_group_ids:  # every DE group leader pulls, in group-id order
            if queue:
                self._phase1(st, queue, now, trace)
            self._phase2(gid, st.de_groups[gid], st, out, now, trace)

    def _phase1(self, st: RoundState, queue: deque[Held], now: float, trace: DecisionTrace) -> None:
        if len(st.de_group_ids) == 1 and not trace.enabled:  # one EP group: nothing to choose
            gid = st.de_group_ids[0]
            self.private.setdefault(gid, deque()).extend(queue)
            added = sum(hbm_tokens(r) for r, _ in queue)
            self.private_tokens[gid] = self.private_tokens.get(gid, 0) + added
            queue.clear()
            return
        tok_sum, private_tokens = st.de_tok_sum, self.private_tokens
        heap = [(tok_sum[gid] + private_tokens.get(gid, 0), gid) for gid in st.de_group_ids]
        heapq.heapify(heap)
        while queue:
            item = queue.popleft()
            load, gid = heap[0]
            need = hbm_tokens(item[0])
            if trace.enabled:
                ranked = sorted(heap)
                trace.add(
                    "de_group",
                    now,
                    request=item[0].request_id,
                    chosen_group=gid,
                    chosen_load_tokens=load,
                    num_groups=len(heap),
                    runners_up=[
                        {"group": g, "load_tokens": x} for x, g in ranked[1 : 1 + RUNNERS_UP]
                    ],
                )
            heapq.heapreplace(heap, (load + need, gid))
            self.private.setdefault(gid, deque()).append(item)
            self.private_tokens[gid] = self.private_tokens.get(gid, 0) + need

    def _phase2(
        self,
        gid: int,
        des: list[int],
        st: RoundState,
        out: list[Placed],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        pq = self.private.get(gid)
        if not pq:
            return
        free = st.free
        total_free = st.de_free_sum[gid]
        prefix_tokens = num_prefix = 0
        for r, _ in pq:
            need = r.prompt_tokens + r.output_tokens  # len_r (hbm_tokens), inlined: hot loop
            if prefix_tokens + need > total_free:
                break
            prefix_tokens += need
            num_prefix += 1
        z = self.z_factor * (prefix_tokens + st.de_tok_sum[gid]) / len(des)
        st.open_de_group(gid)  # the members' own tok_e from here on
        cands = _Candidates(des, st, z)
        # the pull can reach at most request num_prefix (then the group's free HBM is short);
        # floors[k] = smallest len_r from the k-th pop on, for pruning hopeless DEs
        floors = [r.prompt_tokens + r.output_tokens for r, _ in islice(pq, num_prefix + 1)]
        for k in range(len(floors) - 2, -1, -1):
            floors[k] = min(floors[k], floors[k + 1])
        k = 0
        while pq:
            r, pe = pq[0]
            need = r.prompt_tokens + r.output_tokens
            cands.floor = floors[k] if k < len(floors) else need
            k += 1
            chosen, normal = cands.choose(need)
            if chosen < 0:
                if trace.enabled:
                    trace.add(
                        "de_wait",
                        now,
                        request=r.request_id,
                        group=gid,
                        len_tokens=need,
                        max_free_tokens=max(free[e] for e in des),
                        z_tokens=z,
                    )
                return
            if trace.enabled:
                _record(trace, now, r.request_id, gid, des, st, need, z, num_prefix, chosen, normal)
            pq.popleft()
            self.private_tokens[gid] -= need
            cands.take(chosen, need)
            out.append((r, pe, chosen))


class _Candidates:
    """The DEs of one group during one pull, for phase 2's choice in O(log n).

    ``by_seq`` orders (seq, tok, id), ``by_tok`` orders (tok, id); entries carry a version and
    are dropped when stale. Over a pull free HBM only shrinks and tok_e only grows, so the
    normal set for length L only shrinks, and shrinks as L grows: once a request of length L
    found no normal DE, no later request of length ≥ L can (``no_normal_len``). ``by_tok`` is
    built only when first needed (bursts from an idle cluster rarely need it).
    """

    __slots__ = (
        "by_seq",
        "by_tok",
        "floor",
        "free",
        "no_normal_len",
        "seq",
        "st",
        "tok",
        "ver",
        "z",
    )

    def __init__(self, des: list[int], st: RoundState, z: float) -> None:
        self.st = st
        self.free, self.tok, self.seq, self.z = st.free, st.tok, st.seq, z
        self.ver = dict.fromkeys(des, 0)
        self.by_seq = [(st.seq[e], st.tok[e], e, 0) for e in des if st.free[e] > 0]
        heapq.heapify(self.by_seq)
        self.by_tok: list[tuple[int, int, int]] | None = None
        self.no_normal_len = float("inf")
        self.floor = 0  # no request left in this pull is shorter: DEs that cannot take even
        # this many tokens (no room, or tok_e + floor > Z) are dropped from the heaps for good

    def choose(self, need: int) -> tuple[int, bool]:
        """(DE, is_normal) for a request of ``need`` HBM tokens; (-1, False) if none has room."""
        if need < self.no_normal_len:
            if self.by_tok is None:
                e = _min_seq_normal(self, need)
                if e >= 0:
                    return e, True
            else:
                best = _min_tok_with_room(self, self.by_tok, need)
                if best < 0:
                    return -1, False
                if self.tok[best] + need <= self.z:
                    return _min_seq_normal(self, need), True
            self.no_normal_len = need
        if self.by_tok is None:
            free = self.free
            self.by_tok = [(self.tok[e], e, v) for e, v in self.ver.items() if free[e] > 0]
            heapq.heapify(self.by_tok)
        return _min_tok_with_room(self, self.by_tok, need), False

    def take(self, e: int, need: int) -> None:
        self.st.take_de(e, need)
        t, s, f = self.tok[e], self.seq[e], self.free[e]
        v = self.ver[e] = self.ver[e] + 1
        if f > 0:
            heapq.heappush(self.by_seq, (s, t, e, v))
            if self.by_tok is not None:
                heapq.heappush(self.by_tok, (t, e, v))


def _min_tok_with_room(c: _Candidates, heap: list[tuple[int, int, int]], need: int) -> int:
    """The DE with room for ``need`` and the smallest (tok, id) in ``heap``; -1 if none."""
    ver, free, floor = c.ver, c.free, c.floor
    aside = []
    best = -1
    while heap:
        _t, e, v = heap[0]
        if v != ver[e] or free[e] < floor:
            heapq.heappop(heap)  # stale, or no room for any request left in this pull
        elif free[e] >= need:
            best = e
            break
        else:
            aside.append(heapq.heappop(heap))
    for item in aside:
        heapq.heappush(heap, item)
    return best


def _min_seq_normal(c: _Candidates, need: int) -> int:
    """The normal DE with the smallest (seq, tok, id); -1 if none."""
    heap, ver, free, floor, z = c.by_seq, c.ver, c.free, c.floor, c.z
    aside = []
    chosen = -1
    while heap:
        _s, t, e, v = heap[0]
        if v != ver[e] or free[e] < floor or t + floor > z:
            heapq.heappop(heap)  # stale, or never normal again in this pull
        elif free[e] >= need and t + need <= z:
            chosen = e
            break
        else:
            aside.append(heapq.heappop(heap))
    for item in aside:
        heapq.heappush(heap, item)
    return chosen


def _record(
    trace: DecisionTrace,
    now: float,
    request_id: int,
    gid: int,
    des: list[int],
    st: RoundState,
    need: int,
    z: float,
    num_prefix: int,
    chosen: int,
    normal: bool,
) -> None:
    tok, seq, free = st.tok, st.seq, st.free
    room = [e for e in des if free[e] >= need]
    normals = sorted((seq[e], tok[e], e) for e in room if tok[e] + need <= z)
    highs = sorted((tok[e], e) for e in room if tok[e] + need > z)
    ranked = [e for _, _, e in normals] if normal else [e for _, e in highs]
    ups = [{"engine": e, "seq": seq[e], "tokens": tok[e]} for e in ranked[1 : 1 + RUNNERS_UP]]
    trace.add(
        "de",
        now,
        request=request_id,
        rule="dualpath",
        group=gid,
        len_tokens=need,
        z_tokens=z,
        num_prefix_r=num_prefix,
        num_normal=len(normals),
        num_high_token=len(highs),
        num_no_room=len(des) - len(room),
        decision="normal" if normal else "high_token",
        chosen=chosen,
        chosen_seq=seq[chosen],
        chosen_tokens=tok[chosen],
        chosen_free_tokens=free[chosen],
        runners_up=ups,
    )
