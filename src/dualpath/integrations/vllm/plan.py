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
  across nodes each layer of a block goes on to the DE buffer once the block is final (its
  ``forward``), so that no bytes are sent twice and none overtake newer ones;
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
  (``SlotOwners.release``), so no slot outlives its request;
- a prefill pins the leased slots it loads from and saves into in the first step that
  schedules it (``SlotOwners.pin``) and unpins them once it left vLLM and every step planned
  before it left has run: at once when vLLM runs one step at a time, else (pipeline
  parallelism, asynchronous scheduling: ``steps_in_flight`` > 1, and a step that saves into
  them may still be running when vLLM aborts the request) once those steps' outputs came
  back (``step_done``), or ``steps_in_flight`` steps later, when vLLM cannot have any of them
  in flight. A router that gives the request up meanwhile releases them, and they are free
  once no step writes them any more. A lease already gone makes the load ``lost`` and drops
  the saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dualpath.integrations.vllm.params import BlockLoad, TransferParams
from dualpath.kv.store import block_keys

NULL_BLOCK = 0  # vLLM's null block (``BlockPool.null_block``): a sliding window's skipped block


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Paged blocks ``block_ids`` ↔ node ``node``'s buffer slots ``slots`` (pairwise).
    ``block_ids`` are KV cache group 0's; ``other_groups[g - 1]`` group ``g``'s blocks at the
    same positions (a hybrid model's groups: each layer's KV lives in its group's blocks)."""

    request_id: str
    node: int
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    other_groups: tuple[tuple[int, ...], ...] = ()
    forward: Forward | None = None  # a save's: where its final blocks' layers go on to

    def group(self, g: int) -> tuple[int, ...]:
        return self.block_ids if g == 0 else self.other_groups[g - 1]


@dataclass(frozen=True, slots=True)
class Forward:
    """A save's first ``len(slots)`` blocks (those this step completes: a partial last block
    waits for the step that fills it) go on to node ``node``'s slots ``slots``, layer by
    layer as each is saved, as hand-over ``job`` (``params.BlockForward``)."""

    node: int
    slots: tuple[int, ...]
    job: str


@dataclass(frozen=True, slots=True)
class SlotPersist:
    """Slots of node ``node``'s buffer that already hold Full Blocks ``keys``: persist them
    (the side-car frees each once durable); ``free``: the request's other slots, now unused.
    ``job``: the side-car carries it out once every worker that loads from the slots said
    it is done with them (``worker.WorkerSide.end_step``)."""

    request_id: str
    node: int
    keys: tuple[str, ...]
    slots: tuple[int, ...]
    free: tuple[int, ...]
    job: str = ""


@dataclass(frozen=True, slots=True)
class PagedPersist:
    """Paged blocks ``block_ids`` (every layer; group ``g``'s at ``other_groups[g - 1]``) to
    copy into slots ``slots`` of node ``node``'s buffer (allocated by the scheduler half, so
    that every worker of the instance copies its part into the same ones) and persist as
    ``keys`` once every worker that writes a part is done (``job``)."""

    request_id: str
    node: int
    block_ids: tuple[int, ...]
    keys: tuple[str, ...]
    slots: tuple[int, ...] = ()
    job: str = ""
    other_groups: tuple[tuple[int, ...], ...] = ()

    def group(self, g: int) -> tuple[int, ...]:
        return self.block_ids if g == 0 else self.other_groups[g - 1]


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
    """Who holds a node buffer's slots (``SlotBuffer.transfer`` / ``release`` / ``alloc``)."""

    def alloc(self, node: int, n: int) -> list[int] | None:
        """``n`` free slots of ``node`` for this instance (None: not that many free)."""
        ...

    def claim(self, node: int, slots: Sequence[int], lease: int) -> bool:
        """Take ``slots`` of ``node`` out of lease ``lease`` for this instance, all or none."""
        ...

    def release(self, node: int, slots: Sequence[int], lease: int) -> int:
        """Free the ``slots`` of ``node`` still leased under ``lease``; how many."""
        ...

    def pin(self, node: int, slots: Sequence[int], lease: int) -> bool:
        """Pin ``slots`` of ``node``, all still under ``lease``, for this instance: a release
        meanwhile frees them only once they are unpinned. All or none."""
        ...

    def unpin(self, node: int, slots: Sequence[int]) -> int:
        """This instance is done with ``slots`` of ``node``; how many pins ended."""
        ...


@dataclass(slots=True)
class _Req:
    params: TransferParams
    token_ids: Sequence[int]  # the request's tokens (vLLM's live list: grows as it decodes)
    prompt_tokens: int
    local_tokens: int = 0  # computed from the instance's own prefix cache
    load_tokens: int = 0  # tokens the load supplies (0: no load)
    groups: list[list[int]] = field(default_factory=lambda: [[]])  # block ids per KV group
    saved_blocks: int = 0  # save: blocks before this one are done
    persisted_blocks: int = 0  # persist: blocks before this one are on their way to the store
    loaded: bool = False
    pinned: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (node, slots)
    unpinnable: bool = False  # a prefill whose lease was gone: no load, no saves

    @property
    def block_ids(self) -> list[int]:
        return self.groups[0]

    def at(self, first: int, end: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """Group 0's block ids at positions ``first..end-1``, and the other groups'."""
        parts = [tuple(g[first:end]) for g in self.groups]
        return parts[0], tuple(parts[1:])


BlockIds = Sequence[int] | Sequence[Sequence[int]]


@dataclass(slots=True)
class _Shared:
    """A load shared by several requests (``BlockLoad.shares``): the sharers still to load,
    and the hand-over of its slots that waits for them."""

    waiting: int
    hand_over: SlotPersist


def _lease_key(load: BlockLoad) -> tuple[int, int]:
    return load.node, load.lease


def _groups(ids: BlockIds | None) -> list[list[int]]:
    """Block ids per KV cache group, from one group's list or vLLM's tuple of lists."""
    if not ids:
        return [[]]
    if isinstance(ids[0], int):
        return [[int(b) for b in ids if isinstance(b, int)]]
    return [[int(b) for b in g] for g in ids if not isinstance(g, int)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class StepPlanner:
    """Scheduler-side state of one vLLM instance's DualPath connector (``block_tokens``: its
    paged block size, the store's Full Block)."""

    def __init__(
        self,
        block_tokens: int,
        owners: SlotOwners | None = None,
        job_prefix: str = "j",
        windows: Sequence[int] = (),
        steps_in_flight: int = 1,
    ) -> None:
        """``owners``: claims leased slots and allocates the slots of generated blocks; None:
        leases are not checked and generated blocks get no slots (the planner's own tests of
        what it plans). ``job_prefix``: makes the persist jobs' names unique among the
        instances (and restarts) that share a side-car. ``windows``: each KV cache group's
        sliding window in tokens (0: full attention): a load skips the blocks of a window
        group that no token computed after it can see, as vLLM's own manager skips them.
        ``steps_in_flight``: how many steps vLLM runs at once (its ``max_concurrent_batches``)."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} is invalid: must be >= 1")
        if steps_in_flight < 1:
            raise ValueError(f"steps_in_flight={steps_in_flight} is invalid: must be >= 1")
        if any(w < 0 for w in windows):
            raise ValueError(f"windows={list(windows)} is invalid: each must be >= 0")
        self.block_tokens = block_tokens
        self.windows = tuple(windows)
        self._owners = owners
        self._reqs: dict[str, _Req] = {}
        self._job_prefix = job_prefix
        self._num_jobs = 0
        self._shared: dict[tuple[int, int], _Shared] = {}  # shared loads: sharers to come
        self._due: list[SlotPersist] = []  # hand-overs for the next step
        self.steps_in_flight = steps_in_flight
        self._planned = 0  # steps planned (``step``) ...
        self._ran = 0  # ... and those whose output came back (``step_done``)
        # pins of requests that left, each kept until the steps planned before it left ran
        self._leaving: list[tuple[int, list[tuple[int, tuple[int, ...]]]]] = []

    def _job(self) -> str:
        self._num_jobs += 1
        return f"{self._job_prefix}:{self._num_jobs}"

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
        new: Sequence[tuple[str, BlockIds, int, int]],
        cached: Sequence[tuple[str, BlockIds | None, bool, int, int]],
    ) -> StepMeta:
        """The worker's jobs for a step. ``new``: (request id, its block ids, tokens computed
        before the step, tokens scheduled now) of requests scheduled for the first time;
        ``cached``: (request id, blocks added this step or None, resumed after preemption,
        tokens computed before, tokens scheduled) of the others. Block ids: one group's list,
        or one list per KV cache group (vLLM's tuple)."""
        self._planned += 1
        self._unpin_ran()
        meta = StepMeta()
        meta.slot_persists.extend(self._due)  # shared loads whose last sharer left
        self._due = []
        for rid, block_ids, computed, scheduled in new:
            req = self._reqs.get(rid)
            if req is None:
                continue
            req.groups = _groups(block_ids)
            self._pin(req)
            if req.load_tokens and not req.loaded:
                self._load(rid, req, meta)
            self._after(rid, req, computed + scheduled, meta)
        for rid, added, resumed, computed, scheduled in cached:
            req = self._reqs.get(rid)
            if req is None:
                continue
            if resumed:  # preempted: its blocks are new, what they held is gone
                req.groups = _groups(added)
                req.saved_blocks = min(req.saved_blocks, computed // self.block_tokens)
            elif added:
                for g, more in enumerate(_groups(added)):
                    while len(req.groups) <= g:
                        req.groups.append([])
                    req.groups[g].extend(more)
            self._after(rid, req, computed + scheduled, meta)
        return meta

    def _pin(self, req: _Req) -> None:
        """A prefill's leased slots (its load's and its save's), pinned once, all or none."""
        load, save = req.params.load, req.params.save
        if self._owners is None or req.params.persist is not None or req.pinned:
            return
        wanted = [
            (part.node, part.slots, part.lease)
            for part in (load, save)
            if part is not None and part.lease and part.slots
        ]
        for node, slots, lease in wanted:
            if not self._owners.pin(node, slots, lease):
                req.unpinnable = True
                self._unpin(req)
                return
            req.pinned.append((node, slots))

    def _unpin(self, req: _Req) -> None:
        """The request's pins end once every step planned so far has run."""
        if req.pinned:
            self._leaving.append((self._planned, req.pinned))
        req.pinned = []
        self._unpin_ran()

    def _unpin_ran(self) -> None:
        """End the pins whose steps all ran: their outputs came back, or vLLM runs one step
        at a time, or enough steps were planned since (``steps_in_flight``)."""
        keep = []
        ran = max(self._ran, self._planned - self.steps_in_flight)
        for planned, pins in self._leaving:
            if planned > ran and self.steps_in_flight > 1:
                keep.append((planned, pins))
            elif self._owners is not None:
                for node, slots in pins:
                    self._owners.unpin(node, slots)
        self._leaving = keep

    def step_done(self) -> None:
        """A step's output came back (vLLM's ``update_connector_output``): the steps run in
        the order they were planned, so every step up to this many has run."""
        self._ran = min(self._ran + 1, self._planned)
        self._unpin_ran()

    @property
    def num_pinning(self) -> int:
        """Requests that left whose pins wait for a step still running."""
        return len(self._leaving)

    def _load(self, rid: str, req: _Req, meta: StepMeta) -> None:
        """A load of leased slots. Shared (``BlockLoad.shares``: vLLM's ``n`` choices, each a
        request of the same params), the first sharer claims the slots and the others load
        the same ones (rather than recompute, which would also draw a sampler's random numbers
        for a token thrown away); the hand-over waits for the last sharer (``_share``)."""
        load = req.params.load
        assert load is not None
        req.loaded = True
        first = req.local_tokens // self.block_tokens
        end = min(
            _ceil_div(req.load_tokens, self.block_tokens), len(load.slots), len(req.block_ids)
        )
        ids, others = self._visible(req, first, end, min(req.load_tokens, req.prompt_tokens - 1))
        copy = BlockCopy(rid, load.node, ids, tuple(load.slots[first:end]), others)
        owners, persist = self._owners, req.params.persist
        handed = persist is not None  # a decode: its slots become the instance's
        shared = self._shared.get(_lease_key(load))
        if handed and shared is not None:  # another sharer claimed them: load the same slots
            if end > first:
                meta.loads.append(copy)
            req.persisted_blocks = min(req.prompt_tokens // self.block_tokens, end)
            self._left(_lease_key(load), meta.slot_persists)
            return
        if req.unpinnable or (
            handed and owners is not None and not owners.claim(load.node, load.slots, load.lease)
        ):
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
        hand_over = SlotPersist(
            rid, load.node, tuple(keys), tuple(load.slots[start:full]), free, self._job()
        )
        if load.shares > 1:  # after the last sharer's load
            self._shared[_lease_key(load)] = _Shared(load.shares - 1, hand_over)
        else:
            meta.slot_persists.append(hand_over)
        req.persisted_blocks = full

    def _left(self, key: tuple[int, int], out: list[SlotPersist]) -> None:
        """A sharer of a shared load loaded, or left before it did: the last one hands the
        slots over (into ``out``: this step's or the next one's)."""
        shared = self._shared[key]
        shared.waiting -= 1
        if shared.waiting <= 0:
            del self._shared[key]
            out.append(shared.hand_over)

    def _visible(
        self, req: _Req, first: int, end: int, computed: int
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The block ids at positions ``first..end-1`` that the tokens after ``computed`` can
        still see: a sliding-window group's blocks wholly before its window are the null
        block (the worker skips it; vLLM frees them and never reads them)."""
        groups = [list(g[first:end]) for g in req.groups]
        for g, window in enumerate(self.windows[: len(groups)]):
            if window:
                skipped = max(0, computed - window + 1) // self.block_tokens  # vLLM's rule
                for i in range(first, min(skipped, end)):
                    groups[g][i - first] = NULL_BLOCK
        return tuple(groups[0]), tuple(tuple(g) for g in groups[1:])

    def _after(self, rid: str, req: _Req, computed_after: int, meta: StepMeta) -> None:
        """Saves and persists due once the step has computed ``computed_after`` tokens."""
        bs = self.block_tokens
        save = req.params.save
        if save is not None and not req.unpinnable and req.saved_blocks * bs < req.prompt_tokens:
            done = min(computed_after, req.prompt_tokens)
            first = max(req.saved_blocks, save.first_block)
            end = min(_ceil_div(done, bs), save.first_block + len(save.slots), len(req.block_ids))
            if end > first:
                ids, others = req.at(first, end)
                slots = tuple(save.slots[i - save.first_block] for i in range(first, end))
                forward = None
                if save.forward is not None:  # the blocks no later step writes again
                    final = end if done == req.prompt_tokens else min(end, done // bs)
                    to = tuple(
                        save.forward.slots[i - save.first_block] for i in range(first, final)
                    )
                    forward = Forward(save.forward.node, to, save.forward.job) if to else None
                meta.saves.append(BlockCopy(rid, save.node, ids, slots, others, forward))
            # a partial last block is saved again as it fills; the whole prompt ends the save
            req.saved_blocks = end if done == req.prompt_tokens else done // bs
        persist = req.params.persist
        if persist is not None and req.loaded:
            full = min(computed_after // bs, len(req.block_ids), len(req.token_ids) // bs)
            first = max(req.persisted_blocks, persist.first_block)
            if full > first:
                keys = block_keys(req.token_ids[: full * bs], bs, persist.namespace)[first:full]
                got = self._owners.alloc(persist.node, full - first) if self._owners else []
                ids, others = req.at(first, full)
                # no slots (the DE buffer is full): these blocks are recomputed next turn
                if got is not None:
                    meta.block_persists.append(
                        PagedPersist(
                            rid, persist.node, ids, tuple(keys), tuple(got), self._job(), others
                        )
                    )
                req.persisted_blocks = full

    def finished(self, request_id: str, params: TransferParams | None) -> None:
        """The request left vLLM (finished, aborted; ``params``: its own, for one vLLM never
        asked about): a lease it never claimed goes back."""
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self._unpin(req)  # (after its last step: vLLM frees a request once it ran)
        mine = req.params if req is not None else params
        load = mine.load if mine is not None else None
        unloaded = req is None or not req.loaded
        if load is not None and unloaded and _lease_key(load) in self._shared:
            self._left(_lease_key(load), self._due)  # a sharer that never loaded: one less
            return
        if (req is not None and req.loaded) or self._owners is None:
            return
        if mine is not None and mine.load is not None and mine.persist is not None:
            self._owners.release(mine.load.node, mine.load.slots, mine.load.lease)
