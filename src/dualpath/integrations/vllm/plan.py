"""The connector's scheduler half, without vLLM: which blocks to load, save and persist per step.

vLLM asks the scheduler half of a connector, per request, how many tokens it can supply
(``matched_tokens``), tells it which paged blocks it allocated, and once per engine step asks
for the metadata the worker half acts on (``step``). This module keeps that state and builds a
``StepMeta``; ``connector.py`` only translates vLLM's objects. Per request (``TransferParams``):

- load: the hit blocks (a prefill) or the whole prompt (a decode) from a node buffer into the
  request's first paged blocks, before the step that computes the tokens after them (vLLM
  recomputes the last prompt token, so a full-prompt load reports ``prompt − 1`` tokens);
- save: each prompt block from ``first_block`` on, once the step that computes its last token
  ran (a partial last block again at each step, until the prompt is done), layer by layer;
- after a decode's load: its new prompt blocks (``persist.first_block`` on) are persisted from
  the slots they arrived in, and its other slots freed; then every block its generation fills is
  persisted in the step that fills it (design §4), copied from the paged KV to a fresh slot.

The request lifecycle, as vLLM drives it (``tests/integrations/test_vllm_scheduler.py`` runs
a real vLLM ``Scheduler`` through each case):

- a request's load is planned once, in the first step that schedules it. A decode's slots
  are leased to it by the router: the planner claims them then (``SlotOwners.claim``); a
  lease that is gone (the client left and the router took the slots back) makes the load
  ``lost``: the worker reports its blocks as load errors and vLLM recomputes them;
- after a preemption vLLM asks for the matched tokens again: a request that loaded reports
  none (its slots were persisted or freed), so vLLM recomputes, never reads stale pages;
- a decode that finishes or is aborted before its load gives its lease back
  (``SlotOwners.release``), so no slot outlives its request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dualpath.integrations.vllm.params import TransferParams
from dualpath.kv.store import block_keys


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Paged blocks ``block_ids`` ↔ node ``node``'s buffer slots ``slots`` (pairwise)."""

    request_id: str
    node: int
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SlotPersist:
    """Slots of node ``node``'s buffer that already hold Full Blocks ``keys``: persist them
    (the side-car frees each once durable); ``free``: the request's other slots, now unused."""

    request_id: str
    node: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    free: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PagedPersist:
    """Paged blocks ``block_ids`` (every layer) to copy into fresh slots of node ``node``'s
    buffer and persist as ``keys``."""

    request_id: str
    node: int
    block_ids: tuple[int, ...]
    keys: tuple[str, ...]


@dataclass(slots=True)
class StepMeta:
    """What the worker half does in one engine step (vLLM's ``KVConnectorMetadata``)."""

    loads: list[BlockCopy] = field(default_factory=list)
    lost: list[BlockCopy] = field(default_factory=list)  # loads whose lease was gone
    saves: list[BlockCopy] = field(default_factory=list)
    slot_persists: list[SlotPersist] = field(default_factory=list)
    block_persists: list[PagedPersist] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.loads or self.lost or self.saves or self.slot_persists or self.block_persists
        )


class SlotOwners(Protocol):
    """Who holds a node buffer's slots (``SlotBuffer.transfer`` / ``release`` of the node)."""

    def claim(self, node: int, slots: Sequence[int], lease: int) -> bool:
        """Take ``slots`` of ``node`` out of lease ``lease`` for this instance, all or none."""
        ...

    def release(self, node: int, slots: Sequence[int], lease: int) -> int:
        """Free the ``slots`` of ``node`` still leased under ``lease``; how many."""
        ...


@dataclass(slots=True)
class _Req:
    params: TransferParams
    token_ids: Sequence[int]  # the request's tokens (vLLM's live list: grows as it decodes)
    prompt_tokens: int
    local_tokens: int = 0  # computed from the instance's own prefix cache
    load_tokens: int = 0  # tokens the load supplies (0: no load)
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # save: blocks before this one are done
    persisted_blocks: int = 0  # persist: blocks before this one are on their way to the store
    loaded: bool = False


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class StepPlanner:
    """Scheduler-side state of one vLLM instance's DualPath connector (``block_tokens``: its
    paged block size, the store's Full Block)."""

    def __init__(self, block_tokens: int, owners: SlotOwners | None = None) -> None:
        """``owners``: claims leased slots; None: leases are not checked (the planner's own
        tests of what it plans)."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} is invalid: must be >= 1")
        self.block_tokens = block_tokens
        self._owners = owners
        self._reqs: dict[str, _Req] = {}

    def matched_tokens(
        self,
        request_id: str,
        params: TransferParams | None,
        token_ids: Sequence[int],
        prompt_tokens: int,
        num_computed: int,
    ) -> int:
        """Tokens the load supplies beyond ``num_computed`` (vLLM computes at least one)."""
        if params is None:
            return 0
        req = self._reqs.get(request_id)
        if req is None:
            req = self._reqs[request_id] = _Req(params, token_ids, prompt_tokens)
        req.local_tokens = num_computed
        if params.load is None or req.loaded:  # loaded once: after a preemption, recompute
            return 0
        usable = min(params.load.num_tokens, prompt_tokens - 1)
        return max(0, usable - num_computed)

    def allocated(self, request_id: str, num_external: int) -> None:
        """vLLM allocated blocks for the request; ``num_external`` tokens come from the load."""
        req = self._reqs.get(request_id)
        if req is not None and num_external > 0 and req.params.load is not None:
            req.load_tokens = req.params.load.num_tokens

    def knows(self, request_id: str) -> bool:
        return request_id in self._reqs

    def step(
        self,
        new: Sequence[tuple[str, Sequence[int], int, int]],
        cached: Sequence[tuple[str, Sequence[int] | None, bool, int, int]],
    ) -> StepMeta:
        """The worker's jobs for a step. ``new``: (request id, its block ids, tokens computed
        before the step, tokens scheduled now) of requests scheduled for the first time;
        ``cached``: (request id, blocks added this step or None, resumed after preemption,
        tokens computed before, tokens scheduled) of the others."""
        meta = StepMeta()
        for rid, block_ids, computed, scheduled in new:
            req = self._reqs.get(rid)
            if req is None:
                continue
            req.block_ids = list(block_ids)
            if req.load_tokens and not req.loaded:
                self._load(rid, req, meta)
            self._after(rid, req, computed + scheduled, meta)
        for rid, added, resumed, computed, scheduled in cached:
            req = self._reqs.get(rid)
            if req is None:
                continue
            if resumed:  # preempted: its blocks are new, what they held is gone
                req.block_ids = list(added or ())
                req.saved_blocks = min(req.saved_blocks, computed // self.block_tokens)
            elif added:
                req.block_ids.extend(added)
            self._after(rid, req, computed + scheduled, meta)
        return meta

    def _load(self, rid: str, req: _Req, meta: StepMeta) -> None:
        load = req.params.load
        assert load is not None
        req.loaded = True
        first = req.local_tokens // self.block_tokens
        end = min(
            _ceil_div(req.load_tokens, self.block_tokens), len(load.slots), len(req.block_ids)
        )
        copy = BlockCopy(
            rid, load.node, tuple(req.block_ids[first:end]), tuple(load.slots[first:end])
        )
        owners, persist = self._owners, req.params.persist
        handed = persist is not None  # a decode: its slots become the instance's
        if handed and owners is not None and not owners.claim(load.node, load.slots, load.lease):
            meta.lost.append(copy)  # the router took them back: vLLM recomputes
            return
        if end > first:
            meta.loads.append(copy)
        if persist is None:
            return
        # a decode: the prompt's blocks the store lacks go from their slots to the store
        full = min(req.prompt_tokens // self.block_tokens, end)
        start = min(persist.first_block, full)
        keys = block_keys(
            req.token_ids[: full * self.block_tokens], self.block_tokens, persist.namespace
        )[start:full]
        kept = set(range(start, full))
        free = tuple(s for i, s in enumerate(load.slots) if i not in kept)
        meta.slot_persists.append(
            SlotPersist(rid, load.node, tuple(keys), tuple(load.slots[start:full]), free)
        )
        req.persisted_blocks = full

    def _after(self, rid: str, req: _Req, computed_after: int, meta: StepMeta) -> None:
        """Saves and persists due once the step has computed ``computed_after`` tokens."""
        bs = self.block_tokens
        save = req.params.save
        if save is not None and req.saved_blocks * bs < req.prompt_tokens:
            done = min(computed_after, req.prompt_tokens)
            first = max(req.saved_blocks, save.first_block)
            end = min(_ceil_div(done, bs), save.first_block + len(save.slots), len(req.block_ids))
            if end > first:
                meta.saves.append(
                    BlockCopy(
                        rid,
                        save.node,
                        tuple(req.block_ids[first:end]),
                        tuple(save.slots[i - save.first_block] for i in range(first, end)),
                    )
                )
            # a partial last block is saved again as it fills; the whole prompt ends the save
            req.saved_blocks = end if done == req.prompt_tokens else done // bs
        persist = req.params.persist
        if persist is not None and req.loaded:
            full = min(computed_after // bs, len(req.block_ids), len(req.token_ids) // bs)
            first = max(req.persisted_blocks, persist.first_block)
            if full > first:
                keys = block_keys(req.token_ids[: full * bs], bs, persist.namespace)[first:full]
                meta.block_persists.append(
                    PagedPersist(rid, persist.node, tuple(req.block_ids[first:full]), tuple(keys))
                )
                req.persisted_blocks = full

    def finished(self, request_id: str, params: TransferParams | None) -> None:
        """The request left vLLM (finished, aborted; ``params``: its own, for one vLLM never
        asked about): a lease it never claimed goes back."""
        req = self._reqs.pop(request_id, None)
        if (req is not None and req.loaded) or self._owners is None:
            return
        mine = req.params if req is not None else params
        if mine is not None and mine.load is not None and mine.persist is not None:
            self._owners.release(mine.load.node, mine.load.slots, mine.load.lease)
