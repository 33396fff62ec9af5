"""PE assignment rules (design §7.1): DualPath's α/β categories, and the baselines' choices.

A rule serves one PE group's pull: it pops requests from the head of the global FIFO queue
and gives each a PE of that group, updating the round's tok_e / seq_e copies.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from typing import Protocol

from dualpath.policy.state import RoundState
from dualpath.policy.trace import DecisionTrace
from dualpath.policy.view import RequestInfo

RUNNERS_UP = 3


class PrefillRule(Protocol):
    def pull(
        self,
        group_id: int,
        pes: list[int],
        st: RoundState,
        queue: deque[RequestInfo],
        out: list[tuple[RequestInfo, int]],
        now: float,
        trace: DecisionTrace,
    ) -> None: ...


class CategoryPrefill:
    """DualPath (``use_alpha``) or least-loaded PE choice.

    PEs with ``tok_e > β`` are overloaded and never assigned. With ``use_alpha`` the head
    request goes to the PE with the smallest tok_e among those whose node has ``read_q ≤ α``
    (category 2), else among the rest (category 3); without it, to the smallest tok_e overall.
    Ties: lowest engine id. After each assignment tok_e grows by the prompt tokens.
    """

    def __init__(self, alpha_tokens: int, beta_tokens: int, use_alpha: bool) -> None:
        self.alpha = alpha_tokens
        self.beta = beta_tokens
        self.use_alpha = use_alpha
        # the last PE list pulled for, and its PEs by node (the index keeps its lists while
        # the layout stays, so a pull usually finds its list here)
        self._grouped: tuple[list[int], list[tuple[int, list[int]]]] | None = None

    def _by_node(self, pes: list[int], node: Mapping[int, int]) -> list[tuple[int, list[int]]]:
        """``pes`` as (node, its PEs in ``pes`` order) pairs, by first appearance."""
        grouped = self._grouped
        if grouped is not None and grouped[0] is pes:
            return grouped[1]
        by_node: dict[int, list[int]] = {}
        for e in pes:
            by_node.setdefault(node[e], []).append(e)
        pairs = list(by_node.items())
        self._grouped = (pes, pairs)
        return pairs

    def pull(
        self,
        group_id: int,
        pes: list[int],
        st: RoundState,
        queue: deque[RequestInfo],
        out: list[tuple[RequestInfo, int]],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        if not queue:  # nothing to place: skip the scan of the group's PEs
            return
        beta, alpha, tok, seq = self.beta, self.alpha, st.tok, st.seq
        short: list[tuple[int, int]] = []  # category 2 (or all, without α)
        long: list[tuple[int, int]] = []  # category 3
        if self.use_alpha:  # a node's PEs share its read queue: one category per node
            read_q = st.read_q
            for n, on_node in self._by_node(pes, st.node):
                (short if read_q[n] <= alpha else long).extend(
                    [(t, e) for e in on_node if (t := tok[e]) <= beta]
                )
        else:
            short = [(t, e) for e in pes if (t := tok[e]) <= beta]
        heapq.heapify(short)
        heapq.heapify(long)
        while queue and (short or long):
            heap = short if short else long
            if trace.enabled:
                self._record(group_id, pes, st, queue[0], heap is short, now, trace)
            t, e = heap[0]
            r = queue.popleft()
            t += r.prompt_tokens
            tok[e] = t
            seq[e] += 1
            if t > beta:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (t, e))
            out.append((r, e))
        if queue and trace.enabled:
            trace.add(
                "pe_wait", now, group=group_id, num_waiting=len(queue), num_overloaded=len(pes)
            )

    def _record(
        self,
        group_id: int,
        pes: list[int],
        st: RoundState,
        r: RequestInfo,
        in_short: bool,
        now: float,
        trace: DecisionTrace,
    ) -> None:
        cats: dict[int, list[tuple[int, int]]] = {1: [], 2: [], 3: []}
        for e in pes:
            t = st.tok[e]
            if t > self.beta:
                cats[1].append((t, e))
            elif not self.use_alpha or st.read_q[st.node[e]] <= self.alpha:
                cats[2].append((t, e))
            else:
                cats[3].append((t, e))
        category = 2 if in_short else 3
        ranked = sorted(cats[category])
        trace.add(
            "pe",
            now,
            request=r.request_id,
            rule="dualpath" if self.use_alpha else "least_loaded",
            group=group_id,
            category=category,
            num_overloaded=len(cats[1]),
            num_short_read_q=len(cats[2]),
            num_long_read_q=len(cats[3]),
            alpha_tokens=self.alpha,
            beta_tokens=self.beta,
            chosen=ranked[0][1],
            chosen_tokens=ranked[0][0],
            chosen_read_q=st.read_q[st.node[ranked[0][1]]],
            runners_up=[{"engine": e, "tokens": t} for t, e in ranked[1 : 1 + RUNNERS_UP]],
        )


class RoundRobinPrefill:
    """Baseline: the next PE after the group's previous choice, in cyclic engine-id order,
    skipping overloaded PEs (``tok_e > β``: engines pull only while they have room)."""

    def __init__(self, beta_tokens: int) -> None:
        self.beta = beta_tokens
        self._last: dict[int, int] = {}  # group id → engine id chosen last (across rounds)

    def pull(
        self,
        group_id: int,
        pes: list[int],
        st: RoundState,
        queue: deque[RequestInfo],
        out: list[tuple[RequestInfo, int]],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        tok, seq, beta, n = st.tok, st.seq, self.beta, len(pes)
        eligible = sum(1 for e in pes if tok[e] <= beta)
        last = self._last.get(group_id, -1)
        start = next((i for i, e in enumerate(pes) if e > last), 0)
        while queue and eligible:
            for step in range(n):
                e = pes[(start + step) % n]
                if tok[e] <= beta:
                    start = (start + step + 1) % n
                    break
            r = queue.popleft()
            if trace.enabled:
                trace.add(
                    "pe",
                    now,
                    request=r.request_id,
                    rule="round_robin",
                    group=group_id,
                    num_eligible=eligible,
                    num_overloaded=n - eligible,
                    beta_tokens=beta,
                    chosen=e,
                    chosen_tokens=tok[e],
                )
            tok[e] += r.prompt_tokens
            seq[e] += 1
            if tok[e] > beta:
                eligible -= 1
            self._last[group_id] = e
            out.append((r, e))
        if queue and trace.enabled:
            trace.add("pe_wait", now, group=group_id, num_waiting=len(queue), num_overloaded=n)
