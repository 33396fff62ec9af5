"""A turn on its DE: decode started once its prefill is done, admitted into DE HBM (loaded),
each decode step's tokens, the end. Reports each step to the core (the ledger's phases, the
DEs' generated tokens, the bytes moved); owns no table of its own (the turns are intake's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from dualpath.ledger import Persisted, Phase, Topology
from dualpath.ledger.core import Core
from dualpath.metrics.hops import hop
from dualpath.runtime.messages import DecodeDoneMsg, DecodeMsg, TokensMsg
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.scheduler.slots import Slots
from dualpath.types import KVPath, ReuseSource


class EngineInbox(Protocol):
    def send(self, engine: int, msg: Any) -> None: ...


class Decodes:
    def __init__(
        self,
        core: Core[AgentState, Req],
        topo: Topology,
        slots: Slots,
        ports: EngineInbox,
        reqs: Mapping[int, Req],
        block_tokens: int,
        full_block_bytes: int,
    ) -> None:
        self.core, self.topo, self.slots, self.ports, self.reqs = core, topo, slots, ports, reqs
        self.block = block_tokens
        self.full_block_bytes = full_block_bytes
        self.hold = False  # d2p: each DE keeps a turn's pages when it ends (scheduler.holds)

    def first_token(self, req: Req, first_token: int, done_s: float) -> None:
        """Prefill is done: ``req`` leaves its PE with its first token."""
        hop("sched.first_token", req.request_id)
        self.core.first_token(req, done_s)
        req.first_token = first_token

    def start(self, req: Req) -> None:
        """Free its PE-buffer slots and hand it to its DE."""
        self.slots.free_pe(req)
        hop("sched.decode_sent", req.request_id)
        on_de = req.reuse_source is ReuseSource.DE_HBM  # d2p: its DE kept them in HBM
        self.ports.send(
            req.de,
            DecodeMsg(
                req.request_id,
                req.tokens,
                req.first_token,
                req.output_tokens,
                tuple(req.de_slots),
                req.cached // self.block,
                req.sampling,
                req.namespace,
                hold=self.hold,
                resident_blocks=req.cached // self.block if on_de else 0,
            ),
        )

    def loaded(self, req: Req, now: float) -> None:
        """Its DE admitted it: its DE-buffer slots are free, the DE's free pages count it."""
        self.slots.free_de(req)
        self.core.loaded(req, now)
        req.generated = 1  # token 1 counts on the DE from its admission (design §13.4)
        self.core.generated_tokens(req.de, 1)

    def decoding(self, request_id: int) -> Req | None:
        req = self.reqs.get(request_id)
        return req if req is not None and req.phase is Phase.DECODING else None

    def step(self, msg: TokensMsg) -> list[tuple[Req, int]]:
        """One decode step of a DE: its turns still decoding, each with its new token."""
        out = []
        for rid, token in msg.tokens:
            req = self.decoding(rid)
            if req is not None:
                req.generated += 1
                self.core.generated_tokens(msg.engine_id, 1)
                out.append((req, token))
        return out

    def done(self, req: Req, msg: DecodeDoneMsg) -> None:
        """The last token is out and its DE handed its blocks to storage: record it."""
        counters = self.core.counters
        counters.moved(KVPath.DE_BUFFER_TO_DE_HBM, msg.bytes_in)
        persisted = len(msg.persisted_keys) * self.full_block_bytes
        counters.moved(KVPath.DE_TO_STORAGE, persisted)
        self.core.generated_tokens(req.de, -req.generated)
        req.stamp_done(msg.second_token_s, msg.finish_s)
        events = self.core.events
        if msg.persisted_keys and events.wants(Persisted):
            events.emit(Persisted(msg.finish_s, self.topo.node_of(req.de), persisted))
        self.core.finish(req, msg.finish_s)  # records it (TurnDone)

    def leave(self, req: Req) -> None:
        """``req`` was aborted: its generated tokens leave its DE's count."""
        if req.generated:
            self.core.generated_tokens(req.de, -req.generated)
            req.generated = 0
