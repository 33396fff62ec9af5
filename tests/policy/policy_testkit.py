"""Builders for hand-made cluster views, a linear predictor, and a literal (slow) reference
implementation of design §7.1 that the fast policy must match decision for decision."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from dualpath.policy import (
    Assign,
    ClusterView,
    EngineState,
    NodeState,
    PolicyCore,
    PolicyParams,
    RequestInfo,
    build_policy,
)
from dualpath.types import EngineKind, ReadSide

PE, DE = EngineKind.PE, EngineKind.DE


def linear_predict(pairs: Sequence[tuple[int, int]]) -> float:
    """1 ms per (cached + bsz/2) · bsz / 1e6 — monotone in bsz, easy to compute by hand."""
    return sum((c + b / 2) * b for c, b in pairs) / 1e6 * 1e-3


def params(**kw: object) -> PolicyParams:
    base: dict[str, object] = {"alpha_tokens": 1000, "beta_tokens": 10_000, "block_tokens": 64}
    base.update(kw)
    return PolicyParams(**base)  # type: ignore[arg-type]


def policy(name: str = "dualpath", choice: str = "round_robin", **kw: object) -> PolicyCore:
    return build_policy(name, params(**kw), linear_predict, choice)


def pe(eid: int, node: int, tok: int = 0, seq: int | None = None, group: int = 0) -> EngineState:
    return EngineState(eid, node, group, PE, seq if seq is not None else (1 if tok else 0), tok)


def de(
    eid: int, node: int, free: int, tok: int = 0, seq: int | None = None, group: int = 0
) -> EngineState:
    s = seq if seq is not None else (1 if tok else 0)
    return EngineState(eid, node, group, DE, s, tok, free)


def view(engines: Sequence[EngineState], read_q: dict[int, int] | None = None) -> ClusterView:
    """Nodes are inferred from the engines; ``read_q`` maps node id → read queue tokens."""
    kinds = {e.node_id: e.kind for e in engines}
    rq = read_q or {}
    nodes = tuple(NodeState(n, kinds[n], rq.get(n, 0)) for n in sorted(kinds))
    return ClusterView(tuple(sorted(engines, key=lambda e: e.engine_id)), nodes)


def req(rid: int, prompt: int = 100, hit: int = 0, out: int = 10) -> RequestInfo:
    return RequestInfo(rid, prompt, hit, out)


class ReferencePolicy:
    """design §7.1 read literally with O(engines) scans; same documented tie-breaks."""

    def __init__(self, p: PolicyParams) -> None:
        self.p = p
        self.queue: deque[RequestInfo] = deque()
        self.de_queue: deque[tuple[RequestInfo, int]] = deque()
        self.private: dict[int, deque[tuple[RequestInfo, int]]] = {}
        self.holds: dict[int, list[int]] = {}

    def submit(self, r: RequestInfo) -> None:
        self.queue.append(r)

    def schedule(self, v: ClusterView) -> list[Assign]:
        tok = {e.engine_id: e.tokens for e in v.engines}
        seq = {e.engine_id: e.seq for e in v.engines}
        free = {e.engine_id: e.free_hbm_tokens for e in v.engines if e.kind is DE}
        node = {e.engine_id: e.node_id for e in v.engines}
        rq = {n.node_id: n.read_queue_tokens for n in v.nodes}
        for p_, (t, c) in self.holds.items():
            tok[p_] += t
            seq[p_] += c
        groups = lambda k: sorted({e.group_id for e in v.engines if e.kind is k})  # noqa: E731
        members = lambda k, g: [  # noqa: E731
            e.engine_id for e in v.engines if e.kind is k and e.group_id == g
        ]
        all_pes = [e.engine_id for e in v.engines if e.kind is PE]
        for pes in [all_pes] if all_pes else []:  # the leaders' pulls served as one
            while self.queue:
                ok = [e for e in pes if tok[e] <= self.p.beta_tokens]
                cat2 = [e for e in ok if rq[node[e]] <= self.p.alpha_tokens]
                cands = cat2 or ok
                if not cands:
                    break
                e = min(cands, key=lambda x: (tok[x], x))
                r = self.queue.popleft()
                tok[e] += r.prompt_tokens
                seq[e] += 1
                self.holds.setdefault(e, [0, 0])
                self.holds[e][0] += r.prompt_tokens
                self.holds[e][1] += 1
                self.de_queue.append((r, e))
        out: list[Assign] = []
        need = lambda r: r.prompt_tokens + r.output_tokens  # noqa: E731
        for g in groups(DE):
            while self.de_queue:
                load = {
                    h: sum(tok[e] for e in members(DE, h))
                    + sum(need(r) for r, _ in self.private.get(h, ()))
                    for h in groups(DE)
                }
                best = min(load, key=lambda h: (load[h], h))
                self.private.setdefault(best, deque()).append(self.de_queue.popleft())
            pq = self.private.get(g, deque())
            des = members(DE, g)
            total, acc = sum(free[e] for e in des), 0
            for r, _ in pq:
                if acc + need(r) > total:
                    break
                acc += need(r)
            z = self.p.z_factor * (acc + sum(tok[e] for e in des)) / len(des)
            while pq:
                r, p_ = pq[0]
                n = need(r)
                room = [e for e in des if free[e] >= n]
                if not room:
                    break
                normal = [e for e in room if tok[e] + n <= z]
                if normal:
                    e = min(normal, key=lambda x: (seq[x], tok[x], x))
                else:
                    e = min(room, key=lambda x: (tok[x], x))
                pq.popleft()
                tok[e] += n
                seq[e] += 1
                free[e] -= n
                self.holds[p_][0] -= r.prompt_tokens
                self.holds[p_][1] -= 1
                if not self.holds[p_][1]:
                    del self.holds[p_]
                out.append(self._side(r, p_, e, node, rq))
        return out

    def _side(self, r: RequestInfo, p_: int, d: int, node: dict[int, int], rq: dict[int, int]):  # type: ignore[no-untyped-def]
        if r.hit_tokens == 0:
            return Assign(r.request_id, p_, d, ReadSide.NONE, 0, 0)
        if rq[node[d]] < rq[node[p_]]:
            rq[node[d]] += r.hit_tokens
            return Assign(r.request_id, p_, d, ReadSide.DE, 0, r.hit_tokens)
        rq[node[p_]] += r.hit_tokens
        return Assign(r.request_id, p_, d, ReadSide.PE, r.hit_tokens, 0)
