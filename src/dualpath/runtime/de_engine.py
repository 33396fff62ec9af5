"""The DE process: iteration-level batched decode over a paged HBM, with per-block persists.

Requests wait in a local FIFO until the HBM pool has pages for their whole KV (prompt +
output, every layer); admitted, their prompt KV is loaded from the DE buffer (the scheduler
frees those slots on ``LoadedMsg``, so a DE that dies never double-frees). Every step decodes
one token of every running request in one batched forward pass (design §7.2: a DE runs all its
requests in one batch); new requests join between steps. Every block that fills is copied
into a fresh slot of this node's buffer (waiting for space: backpressure) and handed to the
node's storage worker (design §4: the DE persists the turn's new blocks).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.store import block_keys
from dualpath.metrics.hops import hop
from dualpath.runtime.decode_kv import DecodeKV
from dualpath.runtime.engine import Engine, TransferWindow
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import hold_until
from dualpath.runtime.messages import (
    CancelMsg,
    DecodeDoneMsg,
    DecodeMsg,
    HeldCopiedMsg,
    HeldCopyMsg,
    LoadedMsg,
    PersistMsg,
    ReleaseHeldMsg,
    TokensMsg,
)
from dualpath.runtime.token_choice import Chooser, choose_batch


@dataclass(slots=True)
class _Running:
    msg: DecodeMsg
    tokens: list[int]  # tokens whose KV is in HBM (prompt, then generated but the last)
    tables: list[list[int]]  # block table per layer
    chooser: Chooser
    out: list[int] = field(default_factory=list)
    persisted: list[str] = field(default_factory=list)
    second_s: float = 0.0
    bytes_in: int = 0
    cancelled: bool = False

    @property
    def done(self) -> bool:
        stops = self.msg.sampling.stop_token_ids if self.msg.sampling else ()
        return self.cancelled or len(self.out) >= self.msg.output_tokens or self.out[-1] in stops


class DecodeEngine(Engine):
    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        super().__init__(env, engine_id, crash_at)
        self.buffer: SlotBuffer = env.attach_buffer(self.node)
        self.waiting: deque[DecodeMsg] = deque()
        self.running: list[_Running] = []
        # d2p: finished turns' block tables kept for their agents' next turns, by request id
        self.held: dict[int, list[list[int]]] = {}
        # the decode batch's KV kept in attention's layout between steps (decode_kv.py)
        self.batch_kv = DecodeKV(
            self.pool, self.model.num_layers, self.model.device, self.model.dtype
        )

    def close(self) -> None:
        super().close()
        self.buffer.close()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, CancelMsg):
            self._cancel(msg.request_id)
            return
        if isinstance(msg, HeldCopyMsg):
            self._copy_held(msg)
            return
        if isinstance(msg, ReleaseHeldMsg):
            self._release_held(msg.held_id)
            self.env.results.put(HeldCopiedMsg(-1, self.engine_id, 0, self.pool.num_free))
            return
        assert isinstance(msg, DecodeMsg)
        hop("de.received", msg.request_id)
        self.waiting.append(msg)

    def _cancel(self, request_id: int) -> None:
        for m in self.waiting:
            if m.request_id == request_id:  # never admitted: its slots are free to reuse
                self.waiting.remove(m)
                self.env.results.put(LoadedMsg(request_id, self.engine_id, self.pool.num_free))
                return
        for r in self.running:
            if r.msg.request_id == request_id:
                r.cancelled = True

    def _copy_held(self, msg: HeldCopyMsg) -> None:
        """d2p: the held blocks → the buffer slots the PE loads from (over the compute
        network, charged there: the PE's load), then the hold ends."""
        tables = self.held.get(msg.held_id)
        num = 0
        if tables is not None:
            window = TransferWindow(self.env.options.transfer_window)
            bt = self.block_tokens
            for b, slot in enumerate(msg.slots):
                for layer, table in enumerate(tables):
                    window.add(self.push_nowait(msg.node, slot, layer, 0, bt, table[b], False)[1])
            window.drain()
            num = len(msg.slots)
            self._release_held(msg.held_id)
        self.env.results.put(HeldCopiedMsg(msg.request_id, self.engine_id, num, self.pool.num_free))

    def _release_held(self, held_id: int) -> None:
        tables = self.held.pop(held_id, None)
        if tables is not None:
            self.pool.free([p for t in tables for p in t])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _persist(self, r: _Running, block: int) -> None:
        bt = self.block_tokens
        namespace = r.msg.namespace or self.env.namespace
        key = block_keys(r.tokens[: (block + 1) * bt], bt, namespace)[block]
        slot = self.buffer.alloc_wait(1, timeout_s=self.env.options.request_timeout_s)[0]
        window = TransferWindow(self.env.options.transfer_window)
        layers = self.model.num_layers
        self.charge(self.node, layers * bt * self.row_bytes, to_hbm=False)  # the Full Block
        for layer in range(layers):
            page = r.tables[layer][block]
            window.add(self.push_nowait(self.node, slot, layer, 0, bt, page, paced=False)[1])
        window.drain()
        # the scheduler hands it on
        self.env.results.put(PersistMsg(key, slot, self.node, r.msg.request_id, block))
        r.persisted.append(key)

    def _admit(self) -> None:
        """FIFO: admit waiting requests while the pool has pages for their whole KV."""
        layers = self.model.num_layers
        while self.waiting:
            if self.running and not self.env.options.batching:
                return
            msg = self.waiting[0]
            per_layer = self.pool.pages_for(len(msg.tokens) + msg.output_tokens)
            pages = self.pool.alloc(per_layer * layers)
            if pages is None:
                return  # joins between later steps, when finished requests free pages
            self.waiting.popleft()
            tables = [pages[i * per_layer : (i + 1) * per_layer] for i in range(layers)]
            chooser = self.chooser(msg.sampling, (msg.first_token,))
            r = _Running(msg, list(msg.tokens), tables, chooser, [msg.first_token])
            num_prompt = len(msg.tokens)
            window = TransferWindow(self.env.options.transfer_window)
            # the prompt's KV is one H2D of the request: charged once on each link it crosses
            # (d2p: but the blocks this DE held for it, which never left its HBM)
            moved = num_prompt - min(num_prompt, msg.resident_blocks * self.block_tokens)
            self.charge(self.node, moved * layers * self.row_bytes, to_hbm=True)
            for b, slot in enumerate(msg.de_slots):
                n = min(self.block_tokens, num_prompt - b * self.block_tokens)
                for layer in range(layers):
                    page = tables[layer][b]
                    nbytes, done = self.pull_nowait(self.node, slot, layer, 0, n, page, False)
                    r.bytes_in += nbytes
                    window.add(done)
            window.drain()
            hop("de.loaded", msg.request_id)
            self.env.results.put(LoadedMsg(msg.request_id, self.engine_id, self.pool.num_free))
            for b in range(msg.stored_blocks, num_prompt // self.block_tokens):
                self._persist(r, b)
            r.second_s = self.clock.now()
            hop("de.admitted", msg.request_id)
            self.running.append(r)

    def step(self) -> None:
        self._admit()
        active = [r for r in self.running if not r.done]
        if active:
            start = self.clock.now()
            order = self.batch_kv.arrange(
                active, [r.tables for r in active], [len(r.tokens) for r in active]
            )
            active = [active[i] for i in order]  # slot order: the KV lies in that order
            kv = self.batch_kv.batch([r.tables for r in active], [len(r.tokens) for r in active])
            logits = self.model.forward_batch([r.out[-1:] for r in active], kv)
            gens = [_generator(r) for r in active]  # token len(out) of each one's output
            picked = choose_batch([r.chooser for r in active], logits, gens)
            host_s = self.clock.now() - start
            emulated_s = 0.0
            if self.gpu_time is not None:  # the step ends no earlier than its emulated time
                emulated_s = self.gpu_time.decode_s(len(active), sum(kv.past_lens) + len(active))
                hold_until(start + emulated_s, self.clock.now, time.sleep)
            now = self.clock.now()
            for r, (token, _) in zip(active, picked, strict=True):
                r.tokens.append(r.out[-1])
                r.out.append(token)
                if len(r.out) == 2:
                    r.second_s = now
                if len(r.tokens) % self.block_tokens == 0:
                    self._persist(r, len(r.tokens) // self.block_tokens - 1)
            # every step: the scheduler counts tokens generated (tok_e, design §13.4) and streams
            step = tuple((r.msg.request_id, r.out[-1]) for r in active)
            lps = tuple(
                (r.msg.request_id, lp) for r, (_, lp) in zip(active, picked, strict=True) if lp
            )
            for r in active:
                hop("de.step", r.msg.request_id)
            self.env.results.put(TokensMsg(self.engine_id, step, lps, emulated_s, host_s))
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            if r.msg.hold and not r.cancelled:  # d2p: kept for the agent's next turn
                self.held[r.msg.request_id] = r.tables
            else:
                self.pool.free([p for t in r.tables for p in t])
            self.env.results.put(
                DecodeDoneMsg(
                    r.msg.request_id,
                    self.engine_id,
                    tuple(r.out),
                    r.second_s,
                    self.clock.now(),
                    r.bytes_in,
                    tuple(r.persisted),
                    self.pool.num_free,
                )
            )


def _generator(r: _Running) -> Any:
    """The generator of ``r``'s next output token (None: greedy)."""
    s = r.msg.sampling
    return s.generator(len(r.out)) if s is not None and s.temperature > 0.0 else None
