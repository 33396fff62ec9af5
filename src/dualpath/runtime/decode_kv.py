"""A DE's decode-batch KV kept between steps in attention's layout, so a step copies one row
per request and layer instead of gathering every request's whole KV from the HBM pages.

``DecodeKV`` holds, per layer, K and V as ``[slots, kv_heads, capacity, head_dim]`` on the
model's device: slot ``i`` is a running request's, rows ``0..len`` its KV. A request that
joins the batch is copied in once from its pages; one that leaves gives its slot to the last
slot's request (one request's rows move); the batch runs in slot order, so attention reads
``K[:B, :, :L]`` as it lies (``HeadMajorKV``). The HBM pages stay the KV's home: every new row
is written there too (the DE persists Full Blocks from them, and the transports address
them). The gather it replaces was 3-4x the attention itself at 16 requests of 1,500 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dualpath.runtime.hbm import HbmPool
from dualpath.runtime.model import HeadMajorKV

CAPACITY_STEP = 256  # rows added at a time when a request outgrows the capacity


class DecodeKV:
    """See the module docstring. ``arrange`` before each step: the batch in slot order."""

    def __init__(
        self, pool: HbmPool, num_layers: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.pool = pool
        self.num_layers = num_layers
        self.device, self.dtype = device, dtype
        self.slots: list[Any] = []  # the request in each slot
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self._alloc(0, 0)

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def _alloc(self, num_slots: int, capacity: int) -> None:
        """Grow to ``num_slots`` × ``capacity`` rows, keeping what the slots hold."""
        kvh, hd = self.pool.pages.shape[3], self.pool.pages.shape[4]
        shape = (num_slots, kvh, capacity, hd)
        for store in (self.k, self.v):
            old = list(store)
            store.clear()
            for layer in range(self.num_layers):
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old and old[layer].numel():
                    s, c = old[layer].shape[0], old[layer].shape[2]
                    t[:s, :, :c] = old[layer]
                store.append(t)

    def arrange(
        self, reqs: Sequence[Any], tables: Sequence[Sequence[list[int]]], lens: Sequence[int]
    ) -> list[int]:
        """Make the slots hold exactly ``reqs`` (``tables[i]``: request i's block table per
        layer, ``lens[i]`` its KV rows now); the order to run them in (indices into
        ``reqs``, slot order)."""
        where = {id(r): i for i, r in enumerate(reqs)}
        j = 0
        while j < len(self.slots):  # leavers: the last slot's request moves into the gap
            if id(self.slots[j]) in where:
                j += 1
                continue
            while len(self.slots) - 1 > j and id(self.slots[-1]) not in where:
                self.slots.pop()  # a leaver at the end: nothing to move
            last = len(self.slots) - 1
            if last > j:
                n = lens[where[id(self.slots[last])]]
                for layer in range(self.num_layers):
                    self.k[layer][j, :, :n] = self.k[layer][last, :, :n]
                    self.v[layer][j, :, :n] = self.v[layer][last, :, :n]
                self.slots[j] = self.slots[last]
            self.slots.pop()
        held = {id(r) for r in self.slots}
        joining = [i for i, r in enumerate(reqs) if id(r) not in held]
        need_rows = max((n + 1 for n in lens), default=0)
        need_slots = len(self.slots) + len(joining)
        have = int(self.k[0].shape[0])
        if need_slots > have or need_rows > self.capacity:
            rows = max(self.capacity, -(-need_rows // CAPACITY_STEP) * CAPACITY_STEP)
            self._alloc(have if need_slots <= have else max(need_slots, 2 * have), rows)
        for i in joining:  # its KV so far, from its pages: once
            slot = len(self.slots)
            self.slots.append(reqs[i])
            if lens[i]:
                for layer in range(self.num_layers):
                    rows_kv = self.pool.gather(tables[i][layer], lens[i]).to(self.device)
                    self.k[layer][slot, :, : lens[i]] = rows_kv[:, 0].transpose(0, 1)
                    self.v[layer][slot, :, : lens[i]] = rows_kv[:, 1].transpose(0, 1)
        return [where[id(r)] for r in self.slots]

    def batch(self, tables: Sequence[Sequence[list[int]]], past_lens: Sequence[int]) -> StepKV:
        """The ``model.BatchKV`` of one step over the arranged slots (in slot order)."""
        return StepKV(self, tables, past_lens)


class StepKV:
    """``model.BatchKV`` of one decode step: each new row to its pages and its slot; returns
    the slots' K and V as they lie (``HeadMajorKV``)."""

    def __init__(
        self, owner: DecodeKV, tables: Sequence[Sequence[list[int]]], past_lens: Sequence[int]
    ) -> None:
        self.owner = owner
        self.tables = tables
        self.past_lens = list(past_lens)

    def update(self, layer: int, new_kv: Tensor, lens: Sequence[int]) -> HeadMajorKV:
        o = self.owner
        if any(n != 1 for n in lens):
            raise ValueError(f"a decode step has one new token per sequence (got {lens})")
        host = new_kv.to("cpu")
        for i, (table, p) in enumerate(zip(self.tables, self.past_lens, strict=True)):
            o.pool.scatter(table[layer], p, host[i : i + 1])
        rows = new_kv.to(o.device, o.dtype)  # [B, 2, kvh, hd]
        b = len(self.past_lens)
        index = torch.tensor(self.past_lens, device=o.device)
        batch = torch.arange(b, device=o.device)
        o.k[layer][batch, :, index] = rows[:, 0]
        o.v[layer][batch, :, index] = rows[:, 1]
        width = max(self.past_lens) + 1
        return HeadMajorKV(o.k[layer][:b, :, :width], o.v[layer][:b, :, :width])
