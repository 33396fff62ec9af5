"""d2p in our runtime (docs/peers.md): a finished turn's pages stay on its DE, pinned, until its
agent's next turn pulls them or the hold's TTL ends (vLLM NixlConnector's decode-side blocks,
``decoder_kv_blocks_ttl``). The ledger's ``Residency`` decides (what is held where, when it
expires, what the policy may reuse); this class carries it out: which turn's pages each
hold is, the pull (the DE copies them to where the PE loads a DE-side hit), the release.
Owns the hold table only."""

from __future__ import annotations

from typing import Any, Protocol

from dualpath.ledger import Topology
from dualpath.ledger.residency import Residency
from dualpath.runtime.messages import HeldCopyMsg, ReleaseHeldMsg
from dualpath.runtime.requests import Req
from dualpath.types import ReuseSource


class EngineInbox(Protocol):
    def send(self, engine: int, msg: Any) -> None: ...


def d2p_residency(topo: Topology, block: int, de_tokens: int, ttl_s: float) -> Residency:
    """The ledger's bookkeeping of d2p's holds on ``topo``'s DEs (``de_tokens``: a DE's HBM)."""
    return Residency(
        "d2p",
        node_of=[topo.node_of(e) for e in topo.engine_ids],
        pe_ids=topo.pe_ids,
        de_ids=topo.de_ids,
        num_nodes=topo.num_nodes,
        block_tokens=block,
        de_capacity_tokens=de_tokens,
        ttl_s=ttl_s,
    )


class Holds:
    """(DE, agent) → the request id whose pages that DE holds."""

    def __init__(self, ports: EngineInbox, topo: Topology, block: int) -> None:
        self.ports, self.topo, self.block = ports, topo, block
        self._held: dict[tuple[int, int], int] = {}

    def kept(self, de: int, agent: int, request_id: int) -> None:
        """Turn ``request_id`` of ``agent`` ended on ``de``, which holds its pages now."""
        self._held[(de, agent)] = request_id

    def released(self, de: int, agent: int) -> None:
        """The ledger ended a hold (TTL, or superseded): the DE frees its pages."""
        request_id = self._held.pop((de, agent), None)
        if request_id is not None:
            self.ports.send(de, ReleaseHeldMsg(request_id))

    def pull(self, req: Req) -> bool:
        """``req`` was placed to reuse a hold (``reuse_source`` DE_HBM / PEER_HBM): the holding
        DE copies its hit blocks into ``req``'s DE-buffer slots. False when no hold is known
        (a DE restarted since): the caller recomputes the hit."""
        if req.reuse_source not in (ReuseSource.DE_HBM, ReuseSource.PEER_HBM):
            return False
        held_id = self._held.pop((req.reuse_engine, req.agent_id), None)
        if held_id is None:
            return False
        slots = tuple(req.de_slots[: req.hit_tokens // self.block])
        node = self.topo.node_of(req.de)
        self.ports.send(req.reuse_engine, HeldCopyMsg(req.request_id, held_id, node, slots))
        return True

    def __len__(self) -> int:
        return len(self._held)


def recompute_beyond(req: Req, tokens: int) -> None:
    """``req``'s hit KV is its first ``tokens`` (what a hold gave it): the rest of its hit is
    computed again (a hold lost to a DE restart; the tokens are the same)."""
    req.cached = min(tokens, req.hit_tokens)
    if req.cached < req.hit_tokens:
        req.hit_tokens = req.kv_tokens = req.cached
