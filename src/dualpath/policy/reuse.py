"""Hits found without storage: the reuse designs the field ships instead of DualPath and
dualpath-resident (docs/peers.md), as one rule over what the engines still hold.

``ReuseRule`` reads a ``Residency`` (who holds which prefix of an agent's KV: a PE's HBM
prefix cache, a DE's held blocks, a node's DRAM tier, a decode node's DRAM) and decides, for
a placed request, which part of its hit comes from there, which part is read from storage
(the system's read-side rule) and which is computed again. ``AffinityPrefill`` and
``AffinityDecode`` send a request to the engine holding its KV where that engine has room
(sticky sessions, llm-d's prefix-cache scorer), else to the wrapped rule's choice.
Deterministic: the residency is the shell's report, ``now`` an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol

from dualpath.policy.commands import Assign
from dualpath.policy.decode import DecodeRule, Held, Placed, hbm_tokens
from dualpath.policy.prefill import PrefillRule
from dualpath.policy.side import SideRule
from dualpath.policy.state import RoundState
from dualpath.policy.trace import DecisionTrace
from dualpath.policy.view import RequestInfo
from dualpath.types import ReadSide, ReuseSource

MECHANISMS = ("recompute", "d2p", "d2p-evictable", "both-read", "dram-tier", "resident")
# queued requests a DE round looks at for affinity (a router scans a bounded window, not a
# whole backlog: a round stays O(window) however long the DE queue grows)
AFFINITY_WINDOW = 128
# where a mechanism sends a request: (the engine kind, the source it looks for there, whether
# the holder is that engine itself rather than its node)
_AFFINITY = MappingProxyType(
    {
        "recompute": ("pe", ReuseSource.PE_HBM, True),
        "dram-tier": ("pe", ReuseSource.PE_DRAM, False),
        "d2p": ("de", ReuseSource.DE_HBM, True),
        "resident": ("de", ReuseSource.DE_DRAM, False),
    }
)


@dataclass(frozen=True, slots=True)
class Resident:
    """``tokens`` of an agent's KV (a prefix, whole blocks) held at ``source``: by engine
    ``holder`` (``PE_HBM``, ``DE_HBM``) or on node ``holder`` (``PE_DRAM``: a DRAM tier, on
    whichever node; ``DE_DRAM``: a decode node's DRAM)."""

    source: ReuseSource
    holder: int
    tokens: int


class Residency(Protocol):
    """What the engines hold of each agent's KV beyond storage (the shell's report)."""

    def find(self, agent_id: int, now: float) -> Sequence[Resident]:
        """Every place holding a prefix of ``agent_id``'s KV at ``now``, in a fixed order."""
        ...


class NoResidency:
    """Holds nothing (a policy whose shell reports no residency)."""

    def find(self, agent_id: int, now: float) -> Sequence[Resident]:
        return ()


class ReuseRule:
    """``mechanism`` (``MECHANISMS``) decides where a placed request's hit comes from:

    - ``recompute`` (vLLM / SGLang prefix cache, no storage tier): what the PE's HBM prefix
      cache holds is free; the rest of the hit is computed again.
    - ``d2p`` (vLLM NixlConnector ``bidirectional_kv_xfer``; ``d2p-evictable``: held
      blocks that yield to new turns, a what-if): what a DE still holds is
      pulled by the PE over the compute network; held by the request's own DE, it stays
      there (only the new KV goes back), held by another DE (``PEER_HBM``), the PE sends
      it on with the new KV; the rest is read through the PE's storage NIC.
    - ``both-read`` (SGLang PD with decode-side HiCache prefetch): the PE reads the hit
      through its storage NIC and the DE prefetches it through its own; only new KV moves.
    - ``dram-tier`` (vLLM OffloadingConnector, LMCache CPU tier; with ``peer_pull`` vLLM's
      ``p2p`` tier under llm-d): what the PE node's DRAM tier holds is loaded from DRAM;
      else, with ``peer_pull``, from another node's tier over the compute network (the
      holder with the shorter storage read queue, or the longest prefix); the rest is read
      through the PE's storage NIC.
    - ``resident`` (dualpath-resident, beyond the paper): what the DE's node still holds
      in DRAM goes to the PE over the compute network, as a DE-side read without storage;
      the rest is read on the side DualPath's rule picks.
    """

    def __init__(self, mechanism: str, peer_pull: bool = False, peer_source: str = "queue"):
        if mechanism not in MECHANISMS:
            raise ValueError(
                f"reuse mechanism {mechanism!r} is invalid: must be one of {', '.join(MECHANISMS)}"
            )
        if peer_source not in ("queue", "longest"):
            raise ValueError(f"peer_source={peer_source!r} is invalid: queue or longest")
        self.name = mechanism
        self.mechanism = "d2p" if mechanism == "d2p-evictable" else mechanism
        self.peer_pull = peer_pull
        self.peer_source = peer_source
        # d2p's held blocks count as taken in the DEs' free HBM (vLLM's pinned blocks): a
        # request placed on the DE holding its blocks needs that much less room
        self.held_is_taken = mechanism == "d2p"
        self.residency: Residency = NoResidency()

    # ------------------------------------------------------------------ affinity
    def _holder(self, r: RequestInfo, want: ReuseSource, now: float) -> Resident | None:
        """Where the most of ``r``'s KV is held at source ``want`` (ties: the lowest id)."""
        found = [h for h in self.residency.find(r.agent_id, now) if h.source is want]
        return max(found, key=lambda h: (h.tokens, -h.holder)) if found else None

    def preferred_pes(
        self, r: RequestInfo, pes: Sequence[int], node: dict[int, int], now: float
    ) -> list[int]:
        """PEs of ``pes`` that hold (or whose node holds) ``r``'s KV."""
        kind = _AFFINITY.get(self.mechanism)
        if kind is None or kind[0] != "pe" or not r.hit_tokens:
            return []
        best = self._holder(r, kind[1], now)
        if best is None:
            return []
        if kind[2]:
            return [best.holder] if best.holder in pes else []
        return [e for e in pes if node[e] == best.holder]

    def preferred_des(
        self, r: RequestInfo, des: Sequence[int], node: dict[int, int], now: float
    ) -> list[tuple[int, int]]:
        """DEs of ``des`` that hold (or whose node holds) ``r``'s KV, each with the HBM
        tokens of it that count as taken there (``held_is_taken``; else 0)."""
        kind = _AFFINITY.get(self.mechanism)
        if kind is None or kind[0] != "de" or not r.hit_tokens:
            return []
        best = self._holder(r, kind[1], now)
        if best is None:
            return []
        if kind[2]:
            credit = best.tokens if self.held_is_taken else 0
            return [(best.holder, credit)] if best.holder in des else []
        return [(e, 0) for e in des if node[e] == best.holder]

    # ------------------------------------------------------------------ the decision
    def assign(
        self, r: RequestInfo, pe: int, de: int, st: RoundState, side: SideRule, now: float
    ) -> Assign:
        """``r`` placed on ``pe`` and ``de``: where each part of its hit comes from."""
        hit = r.hit_tokens
        if not hit:
            return Assign(r.request_id, pe, de, ReadSide.NONE, 0, 0)
        held = self.residency.find(r.agent_id, now)
        pe_node, de_node = st.node[pe], st.node[de]
        m = self.mechanism
        if m == "both-read":
            st.read_q[pe_node] += hit
            st.read_q[de_node] += hit
            return Assign(r.request_id, pe, de, ReadSide.PE, hit, 0, de_prefetch_tokens=hit)
        source, holder, tokens = _pick(m, held, hit, pe, de, pe_node, de_node, st, self)
        engine = -1
        if source in (ReuseSource.DE_HBM, ReuseSource.PEER_HBM):  # held by engine ``holder``
            engine, holder = holder, st.node[holder]
        tokens = min(tokens, hit)
        rest = hit - tokens
        if m == "recompute":
            return Assign(
                r.request_id,
                pe,
                de,
                ReadSide.NONE,
                0,
                0,
                reuse_source=source,
                reuse_node=holder,
                reuse_tokens=tokens,
                recompute_tokens=rest,
            )
        if m == "resident" and rest:
            plan = side.choose(replace(r, hit_tokens=rest), pe, de, st)
            read_side, pe_read, de_read = plan.side, plan.pe_tokens, plan.de_tokens
        else:  # d2p, dram-tier: what is not held is read through the PE's storage NIC
            read_side = ReadSide.PE if rest else ReadSide.NONE
            pe_read, de_read = rest, 0
            st.read_q[pe_node] += rest
        if not tokens:
            source, holder, engine = ReuseSource.NONE, -1, -1
        return Assign(
            r.request_id,
            pe,
            de,
            read_side,
            pe_read,
            de_read,
            reuse_source=source,
            reuse_node=holder,
            reuse_engine=engine,
            reuse_tokens=tokens,
        )


def _pick(
    m: str,
    held: Sequence[Resident],
    hit: int,
    pe: int,
    de: int,
    pe_node: int,
    de_node: int,
    st: RoundState,
    rule: ReuseRule,
) -> tuple[ReuseSource, int, int]:
    """(source, holder, tokens) the mechanism uses for a request of ``hit`` tokens on ``pe``
    / ``de``: the holder is the engine for HBM sources, else the node. d2p uses a hold only
    when it covers the whole hit (the next turn's hits are its previous context: a hold
    covers them unless it is stale)."""
    none = (ReuseSource.NONE, -1, 0)
    if m == "recompute":
        got = [h.tokens for h in held if h.source is ReuseSource.PE_HBM and h.holder == pe]
        return (ReuseSource.PE_HBM, pe_node, max(got)) if got else none
    if m == "d2p":  # the PE pulls from whichever DE holds them; the turn's own DE first
        holds = [h for h in held if h.source is ReuseSource.DE_HBM and h.tokens >= hit]
        own = [h for h in holds if h.holder == de]
        if own:
            return ReuseSource.DE_HBM, de, own[0].tokens
        if not holds:
            return none
        best = max(holds, key=lambda h: (h.tokens, -h.holder))
        return ReuseSource.PEER_HBM, best.holder, best.tokens
    if m == "resident":
        got = [h.tokens for h in held if h.source is ReuseSource.DE_DRAM and h.holder == de_node]
        return (ReuseSource.DE_DRAM, de_node, max(got)) if got else none
    tiers = [h for h in held if h.source is ReuseSource.PE_DRAM]  # dram-tier
    local = max((h.tokens for h in tiers if h.holder == pe_node), default=0)
    peers = [h for h in tiers if h.holder != pe_node and h.tokens > local]
    if rule.peer_pull and peers:
        if rule.peer_source == "queue":
            best = min(peers, key=lambda h: (st.read_q.get(h.holder, 0), -h.tokens, h.holder))
        else:
            best = min(peers, key=lambda h: (-h.tokens, h.holder))
        return ReuseSource.PEER_DRAM, best.holder, best.tokens
    return (ReuseSource.PE_DRAM, pe_node, local) if local else none


class AffinityPrefill:
    """A request whose KV a PE of the pulling group holds (``ReuseRule.preferred_pes``) goes
    to the least loaded of those PEs that is not overloaded (``tok_e ≤ β``); any other
    request, or one whose holders are all overloaded, to the wrapped rule's choice."""

    def __init__(self, base: PrefillRule, reuse: ReuseRule, beta_tokens: int) -> None:
        self.base, self.reuse, self.beta = base, reuse, beta_tokens

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
        tok, seq = st.tok, st.seq
        while queue:
            r = queue[0]
            ok = [e for e in self.reuse.preferred_pes(r, pes, st.node, now) if tok[e] <= self.beta]
            if ok:
                e = min(ok, key=lambda x: (tok[x], x))
                queue.popleft()
                tok[e] += r.prompt_tokens
                seq[e] += 1
                if trace.enabled:
                    trace.add(
                        "pe",
                        now,
                        request=r.request_id,
                        rule="affinity",
                        group=group_id,
                        chosen=e,
                        chosen_tokens=tok[e],
                    )
                out.append((r, e))
                continue
            one = deque([r])
            self.base.pull(group_id, pes, st, one, out, now, trace)
            if one:  # no PE of the group can take it: it stays at the head
                return
            queue.popleft()


class AffinityDecode:
    """Before the wrapped rule's round: each of the first ``AFFINITY_WINDOW`` queued
    requests whose KV a DE holds (``ReuseRule.preferred_des``) goes to the least loaded of
    those DEs with room for it; the rest go through the wrapped rule, in their order."""

    def __init__(self, base: DecodeRule, reuse: ReuseRule) -> None:
        self.base, self.reuse = base, reuse

    def queued_by_group(self) -> dict[int, int]:
        return self.base.queued_by_group()

    def round(
        self,
        st: RoundState,
        queue: deque[Held],
        out: list[Placed],
        now: float,
        trace: DecisionTrace,
    ) -> None:
        if queue:
            st.open_de_groups()
            des = sorted(st.free)
            rest: deque[Held] = deque()
            for i, (r, pe) in enumerate(queue):
                if i >= AFFINITY_WINDOW:  # beyond it, the wrapped rule's order only
                    rest.append((r, pe))
                    continue
                need = hbm_tokens(r)
                ok = [
                    (e, credit)
                    for e, credit in self.reuse.preferred_des(r, des, st.node, now)
                    if st.free[e] + credit >= need
                ]
                if not ok:
                    rest.append((r, pe))
                    continue
                e, credit = min(ok, key=lambda x: (st.tok[x[0]], x[0]))
                st.take_de(e, need)
                st.credit_de(e, credit)
                if trace.enabled:
                    trace.add(
                        "de", now, request=r.request_id, rule="affinity", chosen=e, len_tokens=need
                    )
                out.append((r, pe, e))
            queue.clear()
            queue.extend(rest)
        self.base.round(st, queue, out, now, trace)
