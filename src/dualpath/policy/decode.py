"""DE assignment rules (design §7.1): DualPath's two phases, and the baselines' choices.

Input: the DE queue of requests that already hold a PE, in FIFO order. Output: (request, PE,
DE) triples. A request that no DE has room for stays queued (keeping its PE) for a later round.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from typing import Protocol

from dualpath.policy.state import RoundState
from dualpath.policy.trace import DecisionTrace
from dualpath.policy.view import RequestInfo

Held = tuple[RequestInfo, int]  # a request and the PE it holds
Placed = tuple[RequestInfo, int, int]  # request, PE, DE
RUNNERS_UP = 3


def hbm_tokens(r: RequestInfo) -> int:
    """len_r for DEs: the HBM a request will need (prompt + forced output)."""
    return r.prompt_tokens + r.output_tokens


class DecodeRule(Protocol):
    def queued_by_group(self) -> dict[int, int]: ...

    def round(
        self,
        st: RoundState,
        queue: deque[Held],
        out: list[Placed],
        now: float,
        trace: DecisionTrace,
    ) -> None: ...


class SimpleDecode:
    """Baseline: one pool of all DEs (no groups, no Z). The head request goes to the next DE
    with room after the previous choice in cyclic id order (``round_robin``) or to the DE with
    room and the smallest tok_e, ties lowest id (``least_loaded``). No DE has room ⇒ stop."""

    def __init__(self, choice: str) -> None:
        if choice not in ("round_robin", "least_loaded"):
            raise ValueError(f"engine choice {choice!r} is invalid: round_robin or least_loaded")
        self.choice = choice
        self._last = -1  # DE chosen last (across rounds)

    def queued_by_group(self) -> dict[int, int]:
        return {}

    def round(
        self,
        st: RoundState,
        queue: deque[Held],
        out: list[Placed],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        des = sorted(st.free)
        if not des:
            return
        st.open_de_groups()  # one pool: every DE's tok_e
        free, tok, seq = st.free, st.tok, st.seq
        start = bisect_right(des, self._last) % len(des)  # round robin: first id after last
        by_tok = [(tok[e], e) for e in des]  # least loaded: (tok, id), stale entries skipped
        heapq.heapify(by_tok)
        while queue:
            r, pe = queue[0]
            need = hbm_tokens(r)
            if self.choice == "round_robin":
                chosen, start = _next_with_room(des, start, free, need)
            else:
                chosen = _least_loaded_with_room(by_tok, tok, free, need)
            if chosen < 0:
                if trace.enabled:
                    trace.add(
                        "de_wait",
                        now,
                        request=r.request_id,
                        len_tokens=need,
                        max_free_tokens=max(free.values()),
                    )
                return
            if trace.enabled:
                trace.add(
                    "de",
                    now,
                    request=r.request_id,
                    rule=self.choice,
                    len_tokens=need,
                    num_with_room=sum(1 for e in des if free[e] >= need),
                    chosen=chosen,
                    chosen_tokens=tok[chosen],
                    chosen_seq=seq[chosen],
                )
            queue.popleft()
            self._last = chosen
            st.take_de(chosen, need)
            if self.choice != "round_robin":
                heapq.heappush(by_tok, (tok[chosen], chosen))
            out.append((r, pe, chosen))


def _next_with_room(des: list[int], start: int, free: dict[int, int], need: int) -> tuple[int, int]:
    """First DE with room at or after index ``start`` (cyclic); (-1, start) if none."""
    n = len(des)
    for step in range(n):
        i = (start + step) % n
        if free[des[i]] >= need:
            return des[i], (i + 1) % n
    return -1, start


def _least_loaded_with_room(
    heap: list[tuple[int, int]], tok: dict[int, int], free: dict[int, int], need: int
) -> int:
    aside = []
    best = -1
    while heap:
        t, e = heap[0]
        if t != tok[e]:
            heapq.heappop(heap)  # stale: tok_e only grows within a round
        elif free[e] >= need:
            best = e
            break
        else:
            aside.append(heapq.heappop(heap))
    for item in aside:
        heapq.heappush(heap, item)
    return best
