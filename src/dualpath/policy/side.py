"""Read-side choice (design §7.1 "Read side", §4), split reads and the write side (both beyond
the paper).

Given a request's PE and DE, decide which node's storage NIC reads its hit KV, and update the
round's read-queue copies so later requests in the same round see the new queue lengths; and
which of the two nodes' storage NICs persists the prompt's new blocks (``SideRule.write_node``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dualpath.policy.state import RoundState
from dualpath.policy.view import RequestInfo
from dualpath.types import ReadSide


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Hit tokens read through the PE node's and the DE node's SNIC."""

    side: ReadSide
    pe_tokens: int
    de_tokens: int


NO_READ = ReadPlan(ReadSide.NONE, 0, 0)


def shorter_queue(pe_read_q: int, de_read_q: int) -> ReadSide:
    """DualPath: the node whose read queue is shorter; a tie goes to the PE (classic path)."""
    return ReadSide.DE if de_read_q < pe_read_q else ReadSide.PE


def split_hit(
    hit_tokens: int, pe_read_q: int, de_read_q: int, alpha_tokens: int, block_tokens: int
) -> ReadPlan:
    """Divide whole hit blocks between the two sides in proportion to their headroom.

    Headroom of a node = ``max(0, T − read_q)`` with ``T = max(α, (q_pe + q_de + hit) / 2)``:
    below α both sides have spare read capacity and share by it; above, T is the level that
    equalises the two queues after this read, so the split evens them out (and sends
    everything to the shorter queue when the gap exceeds the hit). Rounding is to the nearest
    block (half to the PE); a trailing partial block goes with the larger share.
    """
    blocks, partial = divmod(hit_tokens, block_tokens)
    level2 = max(2 * alpha_tokens, pe_read_q + de_read_q + hit_tokens)  # 2·T, integer math
    h_pe = max(0, level2 - 2 * pe_read_q)
    h_de = max(0, level2 - 2 * de_read_q)
    total = h_pe + h_de
    pe_blocks = (2 * blocks * h_pe + total) // (2 * total)
    pe = pe_blocks * block_tokens
    de = (blocks - pe_blocks) * block_tokens
    if pe >= de:
        pe += partial
    else:
        de += partial
    side = ReadSide.PE if pe >= de else ReadSide.DE
    return ReadPlan(side, pe, de)


class SideRule:
    """``rule``: "dualpath" (shorter read queue, optional split), "pe" (Basic: always the PE
    side), or "round_robin" (DPL: alternate PE, DE, PE, … over requests with hits).
    ``tie_break`` (dualpath, without split): equal read queues go to the PE node ("pe", the
    default), or to the node whose storage NICs have read fewer bytes so far ("least_read";
    still a tie: the PE). Beyond the paper: equal queues are common while reads are rare, and
    "pe" then loads each prefill node with half of its requests' reads."""

    def __init__(
        self, rule: str, alpha_tokens: int, block_tokens: int, split: bool, tie_break: str = "pe"
    ) -> None:
        if rule not in ("dualpath", "pe", "round_robin"):
            raise ValueError(f"read-side rule {rule!r} is invalid: dualpath, pe or round_robin")
        if tie_break not in ("pe", "least_read"):
            raise ValueError(f"read-side tie_break {tie_break!r} is invalid: pe or least_read")
        self.tie_break = tie_break
        self.rule = rule
        self.alpha = alpha_tokens
        self.block = block_tokens
        self.split = split and rule == "dualpath"
        self._next_de = False  # round_robin: whose turn it is (state across rounds)

    def choose(self, r: RequestInfo, pe: int, de: int, st: RoundState) -> ReadPlan:
        hit = r.hit_tokens
        if hit == 0:
            return NO_READ
        pe_node, de_node = st.node[pe], st.node[de]
        q_pe, q_de = st.read_q[pe_node], st.read_q[de_node]
        if self.split:
            plan = split_hit(hit, q_pe, q_de, self.alpha, self.block)
        elif self.rule == "dualpath":
            side = shorter_queue(q_pe, q_de)
            if q_pe == q_de and self.tie_break == "least_read":
                read = st.read_bytes
                side = ReadSide.DE if read[de_node] < read[pe_node] else ReadSide.PE
            plan = ReadPlan(side, hit, 0) if side is ReadSide.PE else ReadPlan(side, 0, hit)
        elif self.rule == "pe":
            plan = ReadPlan(ReadSide.PE, hit, 0)
        else:
            plan = ReadPlan(ReadSide.DE, 0, hit) if self._next_de else ReadPlan(ReadSide.PE, hit, 0)
            self._next_de = not self._next_de
        st.read_q[pe_node] = q_pe + plan.pe_tokens
        st.read_q[de_node] = st.read_q[de_node] + plan.de_tokens
        return plan

    def write_node(self, pe_node: int, de_node: int, written: Mapping[int, float]) -> int:
        """Which node's SNIC persists a prompt's new blocks, once its prefill handed them to
        the DE node (both nodes then hold them). The paper persists on the DE (its hit ratio
        of ≈ 98.7% leaves little to write); where a turn appends a large share of its prompt,
        the DE's write direction carries as many bytes as a read direction and binds a
        system that spread its reads over both sides. So the rules that use the DE read
        path also spread the writes: the node whose SNIC has been given fewer bytes to write
        (``written``), a tie to the DE. Basic and Layer keep the paper's DE."""
        if self.rule == "pe":
            return de_node
        return pe_node if written.get(pe_node, 0.0) < written.get(de_node, 0.0) else de_node
