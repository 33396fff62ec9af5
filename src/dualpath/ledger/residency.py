"""What the engines hold of each agent's KV beyond storage, for the reuse designs
(``policy.reuse``, docs/peers.md): PE HBM prefix caches, DE blocks held for a TTL, DRAM
tiers, decode-node DRAM. Bookkeeping only: no clock (``now`` is an argument), no I/O.

Each store maps an agent to the prefix of its KV it holds (whole blocks), least recently
used first, within a capacity in tokens; an entry larger than the whole store is not kept.
A shell reports a turn's prefill (``prefill_done``), its placement (``assigned``) and its
end (``finished``); the policy reads ``find``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath.ledger.turn import Turn
from dualpath.policy.reuse import Resident
from dualpath.types import ReuseSource


class LruTokens:
    """agent → tokens held, least recently used first, ``capacity_tokens`` in all; an entry
    expires ``ttl_s`` after it was stored (``inf``: never; 0: nothing is kept)."""

    __slots__ = (
        "_entries",
        "capacity_tokens",
        "evicted_tokens",
        "expired_tokens",
        "total",
        "ttl_s",
    )

    def __init__(self, capacity_tokens: int, ttl_s: float = math.inf) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens={capacity_tokens} is invalid: must be >= 0")
        if not ttl_s >= 0:
            raise ValueError(f"ttl_s={ttl_s} is invalid: must be >= 0")
        self.capacity_tokens = capacity_tokens
        self.ttl_s = ttl_s
        self._entries: OrderedDict[int, tuple[int, float]] = OrderedDict()  # (tokens, stored)
        self.total = 0
        self.evicted_tokens = 0  # pushed out for room
        self.expired_tokens = 0  # dropped at their TTL

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, agent: int, tokens: int, now: float) -> None:
        """Hold ``tokens`` of ``agent``'s KV (replacing what it held), most recently used."""
        self.pop(agent)
        if tokens <= 0 or tokens > self.capacity_tokens or self.ttl_s == 0:
            return
        self._entries[agent] = (tokens, now)
        self.total += tokens
        self.fit(self.capacity_tokens)

    def get(self, agent: int, now: float) -> int:
        """Tokens held for ``agent`` (0: none, or expired: then dropped); marks it used."""
        entry = self._entries.get(agent)
        if entry is None:
            return 0
        tokens, stored = entry
        if now - stored > self.ttl_s:
            self.pop(agent)
            self.expired_tokens += tokens
            return 0
        self._entries.move_to_end(agent)
        return tokens

    def peek(self, agent: int, now: float) -> int:
        """As ``get``, without marking it used or dropping it."""
        entry = self._entries.get(agent)
        if entry is None or now - entry[1] > self.ttl_s:
            return 0
        return entry[0]

    def stored_s(self, agent: int) -> float:
        """When ``agent``'s entry was stored (-1: none)."""
        entry = self._entries.get(agent)
        return -1.0 if entry is None else entry[1]

    def pop(self, agent: int) -> int:
        entry = self._entries.pop(agent, None)
        if entry is None:
            return 0
        self.total -= entry[0]
        return entry[0]

    def fit(self, capacity_tokens: int) -> None:
        """Evict least recently used entries until at most ``capacity_tokens`` are held."""
        while self.total > max(0, capacity_tokens) and self._entries:
            _, (tokens, _) = self._entries.popitem(last=False)
            self.total -= tokens
            self.evicted_tokens += tokens


@dataclass(slots=True)
class _Range:
    """Tokens ``[start, end)`` of an agent's KV, last used at ``stamp``; ``seq``: its id."""

    start: int
    end: int
    stamp: float
    seq: int


class BlockLru:
    """A DRAM tier's blocks, least recently used out first, ``capacity_tokens`` in all: per
    agent, the blocks it holds as ranges of tokens ``[start, end)`` (whole blocks), each with
    the time it was last used. A read touches a prefix's blocks in order, so within a range
    the first blocks are the least recent: eviction takes a range from its front (exactly
    what a per-block LRU does when each read touches its blocks first to last, as the
    runtime's tier, ``kv.tier``). An agent holds a few ranges at most, so a touch costs
    O(its ranges + log ranges held), not O(blocks)."""

    __slots__ = (
        "_heap",
        "_ranges",
        "_seq",
        "capacity_tokens",
        "evicted_tokens",
        "expired_tokens",
        "total",
    )

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens={capacity_tokens} is invalid: must be >= 0")
        self.capacity_tokens = capacity_tokens
        self._ranges: dict[int, list[_Range]] = {}  # agent → its ranges
        self._heap: list[tuple[float, int, int]] = []  # (stamp, seq, agent), lazily stale
        self._seq = 0
        self.total = 0
        self.evicted_tokens = 0
        self.expired_tokens = 0

    def held(self, agent: int) -> int:
        """Tokens of ``agent``'s KV held (no use marked)."""
        return sum(r.end - r.start for r in self._ranges.get(agent, ()))

    def touch(self, agent: int, start: int, end: int, now: float) -> int:
        """Tokens ``[start, end)`` of ``agent``'s KV are used now: held from here on (those
        missing are brought in, read through or computed), most recently used. Returns the
        tokens of them that were held before."""
        if end <= start:
            return 0
        kept: list[_Range] = []
        before = 0
        for r in self._ranges.get(agent, ()):
            lo, hi = max(r.start, start), min(r.end, end)
            if lo >= hi:
                kept.append(r)
                continue
            before += hi - lo
            if r.start < lo:
                kept.append(_Range(r.start, lo, r.stamp, r.seq))
            if hi < r.end:  # the part after: its own identity, the same age
                kept.append(self._new(agent, hi, r.end, r.stamp))
        kept.append(self._new(agent, start, end, now))
        self._ranges[agent] = kept
        self.total += end - start - before
        self._fit()
        return before

    def _new(self, agent: int, start: int, end: int, stamp: float) -> _Range:
        self._seq += 1
        heapq.heappush(self._heap, (stamp, self._seq, agent))
        return _Range(start, end, stamp, self._seq)

    def _fit(self) -> None:
        while self.total > self.capacity_tokens and self._heap:
            _, seq, agent = self._heap[0]
            ranges = self._ranges.get(agent, [])
            r = next((x for x in ranges if x.seq == seq), None)
            if r is None:  # stale: the range was split or dropped
                heapq.heappop(self._heap)
                continue
            cut = min(r.end - r.start, self.total - self.capacity_tokens)
            r.start += cut
            self.total -= cut
            self.evicted_tokens += cut
            if r.start >= r.end:
                ranges.remove(r)
                heapq.heappop(self._heap)
                if not ranges:
                    del self._ranges[agent]


class Residency:
    """The stores of one reuse mechanism on one cluster.

    ``recompute``: one prefix cache per PE (``pe_capacity_tokens``), filled with each
    prompt's whole blocks at its prefill. ``d2p``: one store per DE whose entries expire after
    ``ttl_s``; a finished turn's context stays held on its DE until the agent's next turn
    pulls it (from whichever DE it is placed on) or its TTL ends. Its holds are pinned
    (vLLM's NixlConnector: not renewed, not evicted): they take the DE's HBM from the turns
    placed on it, reported through ``on_pinned(de, tokens held)``, and expire on time
    (``expire``). ``d2p-evictable`` (a what-if): holds yield to a new turn (evicted least
    recently used first). ``dram-tier``:
    one tier per node (``dram_capacity_tokens``), filled with a prompt's blocks on the PE's
    node at its prefill and with the context's on the DE's node when the turn ends (both
    instances offload what they computed). ``resident``: one store per decode node, filled
    with the context when a turn ends. Every entry is a prefix in whole blocks.
    """

    def __init__(
        self,
        mechanism: str,
        *,
        node_of: Sequence[int],
        pe_ids: Sequence[int],
        de_ids: Sequence[int],
        num_nodes: int,
        block_tokens: int,
        pe_capacity_tokens: int = 0,
        de_capacity_tokens: int = 0,
        dram_capacity_tokens: int = 0,
        ttl_s: float = math.inf,
        on_pinned: Callable[[int, int], None] | None = None,
        on_released: Callable[[int, int], None] | None = None,
    ) -> None:
        # d2p's holds are pinned (vLLM's); d2p-evictable's yield (a what-if)
        self.pinned = mechanism == "d2p"
        self.mechanism = mechanism = "d2p" if mechanism == "d2p-evictable" else mechanism
        self.ttl_s = ttl_s
        self._on_pinned = on_pinned
        # d2p: a hold that ends without a pull (TTL, superseded, or its agent pulled another
        # DE's): ``on_released(de, agent)`` tells the shell to free its pages
        self._on_released = on_released
        self._expiries: list[tuple[float, int, int, float]] = []  # (when, DE, agent, stored)
        self.block_tokens = block_tokens
        self._node_of = list(node_of)
        self.de_capacity_tokens = de_capacity_tokens
        self.stores: dict[int, LruTokens] = {}  # engine or node → its store
        self.tiers: dict[int, BlockLru] = {}  # dram-tier: node → its tier
        self.source = ReuseSource.NONE
        if mechanism == "recompute":
            self.source = ReuseSource.PE_HBM
            self.stores = {e: LruTokens(pe_capacity_tokens) for e in pe_ids}
        elif mechanism == "d2p":
            self.source = ReuseSource.DE_HBM
            self.stores = {e: LruTokens(de_capacity_tokens, ttl_s) for e in de_ids}
        elif mechanism == "dram-tier":  # block by block (``BlockLru``), as the runtime's
            self.source = ReuseSource.PE_DRAM
            self.tiers = {n: BlockLru(dram_capacity_tokens) for n in range(num_nodes)}
        elif mechanism == "resident":
            self.source = ReuseSource.DE_DRAM
            nodes = sorted({self._node_of[e] for e in de_ids})
            self.stores = {n: LruTokens(dram_capacity_tokens) for n in nodes}
        elif mechanism != "both-read":  # both-read holds nothing: it reads storage twice
            raise ValueError(f"reuse mechanism {mechanism!r} is unknown")
        self._holders: dict[int, list[int]] = {}  # agent → stores that may hold it
        self.reused_tokens = 0  # hit tokens placed turns found here
        self.recomputed_tokens = 0  # hit tokens placed turns computed again

    # ------------------------------------------------------------------ the policy's view
    def find(self, agent_id: int, now: float) -> list[Resident]:
        out = []
        if self.tiers:  # dram-tier: a use is marked when it is read (``assigned``)
            for holder in self._holders.get(agent_id, ()):
                tokens = self.tiers[holder].held(agent_id)
                if tokens:
                    out.append(Resident(self.source, holder, tokens))
            return out
        for holder in self._holders.get(agent_id, ()):
            tokens = self.stores[holder].get(agent_id, now)
            if tokens:
                out.append(Resident(self.source, holder, tokens))
        return out

    # ------------------------------------------------------------------ what happened
    def prefill_done(self, turn: Turn, now: float) -> None:
        """``turn``'s prompt KV exists on its PE (whole blocks)."""
        blocks = turn.prompt_tokens // self.block_tokens * self.block_tokens
        if self.mechanism == "recompute":
            self._put(turn.pe, turn.agent_id, blocks, now)
        elif self.mechanism == "dram-tier":  # its new blocks, computed by the PE, kept
            self._touch(self._node_of[turn.pe], turn, turn.hit_tokens, blocks, now)

    def assigned(
        self, turn: Turn, reserved_tokens: int, now: float, recomputed_tokens: int = 0
    ) -> None:
        """``turn`` was placed (its ``reuse_tokens`` found here, ``recomputed_tokens`` of its
        hit computed again); its DE has ``reserved_tokens`` of HBM taken by placed turns."""
        self.reused_tokens += turn.reuse_tokens
        self.recomputed_tokens += recomputed_tokens
        if self.tiers:  # the hit is read into the PE node (from its tier, a peer's, storage)
            self._touch(self._node_of[turn.pe], turn, 0, turn.hit_tokens, now)
        if self.mechanism != "d2p":
            return
        store = self.stores[turn.de]
        if turn.reuse_source in (ReuseSource.DE_HBM, ReuseSource.PEER_HBM):
            for de in self._holders.get(turn.agent_id, ()):  # pulled: the holds end
                if self.stores[de].pop(turn.agent_id) and de != turn.reuse_engine:
                    self._released(de, turn.agent_id)  # a stale one elsewhere: freed
                if de != turn.de:
                    self._report(de)
        if not self.pinned:
            store.fit(self.de_capacity_tokens - reserved_tokens)
        self._report(turn.de)

    def expire(self, now: float) -> None:
        """Drop held blocks whose TTL ended by ``now`` (pinned ones free their DE's HBM)."""
        heap = self._expiries
        while heap and heap[0][0] < now:
            _, de, agent, stored = heapq.heappop(heap)
            store = self.stores[de]
            if store.stored_s(agent) == stored:
                store.expired_tokens += store.pop(agent)
                self._released(de, agent)
                self._report(de)

    def next_expiry_s(self) -> float:
        """When the earliest pinned hold may expire (``inf``: none pending); ``expire``
        frees it at any time after that."""
        return self._expiries[0][0] if self._expiries else math.inf

    def set_released(self, on_released: Callable[[int, int], None]) -> None:
        """Report the holds that end without a pull to ``on_released(de, agent)``."""
        self._on_released = on_released

    def _released(self, de: int, agent: int) -> None:
        if self._on_released is not None:
            self._on_released(de, agent)

    def _report(self, de: int) -> None:
        if self.pinned and self._on_pinned is not None:
            self._on_pinned(de, self.stores[de].total)

    def finished(self, turn: Turn, reserved_tokens: int, now: float) -> None:
        """``turn`` ended: its whole context (prompt + output, whole blocks) is on its DE.
        ``reserved_tokens``: the DE's HBM still taken by placed turns."""
        context = turn.prompt_tokens + turn.output_tokens
        blocks = context // self.block_tokens * self.block_tokens
        m = self.mechanism
        if m == "d2p":
            if self.stores[turn.de].pop(turn.agent_id):  # a stale hold of the agent: superseded
                self._released(turn.de, turn.agent_id)
            self._put(turn.de, turn.agent_id, blocks, now)
            if self.pinned and math.isfinite(self.ttl_s):  # its own blocks: no room to find
                heapq.heappush(self._expiries, (now + self.ttl_s, turn.de, turn.agent_id, now))
            else:
                self.stores[turn.de].fit(self.de_capacity_tokens - reserved_tokens)
            self._report(turn.de)
        elif m == "dram-tier":  # the blocks its DE wrote (the turn's new ones), kept there
            self._touch(self._node_of[turn.de], turn, turn.hit_tokens, blocks, now)
        elif m == "resident":
            self._put(self._node_of[turn.de], turn.agent_id, blocks, now)

    def _touch(self, node: int, turn: Turn, start: int, end: int, now: float) -> None:
        self.tiers[node].touch(turn.agent_id, start, end, now)
        holders = self._holders.setdefault(turn.agent_id, [])
        if node not in holders:
            holders.append(node)
            holders.sort()

    def _put(self, holder: int, agent: int, tokens: int, now: float) -> None:
        self.stores[holder].put(agent, tokens, now)
        holders = self._holders.setdefault(agent, [])
        if holder not in holders:
            holders.append(holder)
            holders.sort()

    # ------------------------------------------------------------------ reports
    def held_tokens(self) -> int:
        tiers = sum(t.total for t in self.tiers.values())
        return sum(s.total for s in self.stores.values()) + tiers

    def evicted_tokens(self) -> int:
        tiers = sum(t.evicted_tokens for t in self.tiers.values())
        return sum(s.evicted_tokens for s in self.stores.values()) + tiers

    def expired_tokens(self) -> int:
        return sum(s.expired_tokens for s in self.stores.values())
