"""The scheduler's two memories: node buffer slots (``Slots``) and engines' HBM pages as
their engines last reported them (``Pools``). Each owns its numbers; neither decides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dualpath.kv.buffer import SlotBuffer
from dualpath.ledger import Topology
from dualpath.runtime.requests import Req
from dualpath.types import ReadSide


class BufferSource(Protocol):
    def buffer(self, node: int) -> SlotBuffer: ...


class Slots:
    """A turn's buffer slots: its hit blocks' (PE or DE buffer) and its DE-buffer landing
    slots for prefill's KV. FIFO admission lives with the caller; this only allocates."""

    def __init__(self, buffers: BufferSource, topo: Topology, block_tokens: int) -> None:
        self.buffers = buffers
        self.topo = topo
        self.block = block_tokens

    def alloc(self, req: Req) -> bool:
        """Give ``req`` its slots, or none (False: its buffer is full, it waits)."""
        de_buf = self.buffers.buffer(self.topo.node_of(req.de))
        need = -(-len(req.tokens) // self.block)
        # keep one slot per DE of the node free for its persists, so a DE never waits on
        # slots that only its own next request would release
        reserve = self.topo.gpus_per_node
        if need + reserve > de_buf.spec.num_slots:
            raise ValueError(
                f"request {req.request_id}: {need} DE buffer slots (+{reserve} for "
                f"persists) can never fit a buffer of {de_buf.spec.num_slots}: raise the buffer size"
            )
        if de_buf.num_free < need + reserve:
            return False
        de_slots = de_buf.alloc(need)
        if de_slots is None:
            return False
        pe_slots: list[int] = []
        if req.read_side is ReadSide.PE:
            got = self.buffers.buffer(self.topo.node_of(req.pe)).alloc(req.hit_tokens // self.block)
            if got is None:
                de_buf.free(de_slots)
                return False
            pe_slots = got
        req.de_slots, req.pe_slots = de_slots, pe_slots
        return True

    def free_pe(self, req: Req) -> None:
        if req.pe_slots:
            self.buffers.buffer(self.topo.node_of(req.pe)).free(req.pe_slots)
            req.pe_slots = []

    def free_de(self, req: Req) -> None:
        if req.de_slots:
            self.buffers.buffer(self.topo.node_of(req.de)).free(req.de_slots)
            req.de_slots = []

    def free(self, req: Req) -> None:
        self.free_pe(req)
        self.free_de(req)


class Pools:
    """Every engine's HBM pool in pages of one Layer Block (a PE's and a DE's sizes), the free
    pages each engine last reported, passed on to the core as KV tokens."""

    def __init__(
        self,
        report_free_hbm: Callable[[int, int], None],
        topo: Topology,
        pages: int,
        pe_pages: int,
        num_layers: int,
        block: int,
    ) -> None:
        self.report_free_hbm = report_free_hbm
        self.topo = topo
        self.hbm_pages = pages  # a DE's
        self.pe_hbm_pages = pe_pages
        self.num_layers = num_layers
        self.block = block
        self.free_pages: dict[int, int] = {}  # every engine's, as last reported
        for e in topo.engine_ids:
            self.reset(e)

    def tokens(self, pages: int) -> int:
        """KV tokens that fit in ``pages`` free pages (a page is one layer of one block)."""
        return pages // self.num_layers * self.block

    def report(self, engine: int, pages: int) -> None:
        self.free_pages[engine] = pages
        self.report_free_hbm(engine, self.tokens(pages))

    def reset(self, engine: int) -> None:
        """A fresh engine: its whole pool is free."""
        self.report(engine, self.pe_hbm_pages if self.topo.is_pe(engine) else self.hbm_pages)
