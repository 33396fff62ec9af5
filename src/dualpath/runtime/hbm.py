"""An engine's emulated HBM as a paged pool: fixed pages of one Layer Block each.

A page holds ``page_tokens`` rows of one layer's KV (``[tokens, 2, kv_heads, head_dim]`` in the
model's KV dtype), so a Full Block's Layer Block maps onto exactly one page. Requests own pages
through per-request block tables (one page list per layer) kept by the engine; ``PagedKV``
hands them to a batched forward (``model.BatchKV``). The region is an anonymous mmap registered
with the transport; torch tensors are views of it. On CUDA the pool stays in host memory (the
transports move bytes between host regions; a GPU-direct RDMA transport would register device
memory instead), and each layer's gathered KV is copied to the device by the model.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Sequence

import torch

from dualpath.kv.buffer import PAGE_BYTES


class HbmPool:
    """``num_pages`` pages; thread-safe alloc / free (lowest free pages first)."""

    def __init__(
        self,
        num_pages: int,
        page_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} is invalid: must be >= 1")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.row_bytes = 2 * kv_heads * head_dim * dtype.itemsize
        self.page_bytes = page_tokens * self.row_bytes
        size = -(-num_pages * self.page_bytes // PAGE_BYTES) * PAGE_BYTES
        self.region = mmap.mmap(-1, size)
        flat = torch.frombuffer(self.region, dtype=dtype, count=size // dtype.itemsize)
        n = num_pages * self.page_bytes // dtype.itemsize
        self.pages = flat[:n].view(num_pages, page_tokens, 2, kv_heads, head_dim)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() gives the lowest page
        self._cond = threading.Condition()

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def alloc(self, n: int) -> list[int] | None:
        with self._cond:
            if n > len(self._free):
                return None
            return [self._free.pop() for _ in range(n)]

    def alloc_wait(self, n: int, timeout_s: float) -> list[int]:
        """``n`` pages, waiting for frees; TimeoutError if they never come."""
        if n > self.num_pages:
            raise ValueError(f"{n} HBM pages can never fit a pool of {self.num_pages}")
        with self._cond:
            if not self._cond.wait_for(lambda: n <= len(self._free), timeout=timeout_s):
                raise TimeoutError(f"no {n} free HBM pages within {timeout_s:g} s")
            return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        with self._cond:
            self._free.extend(sorted(pages, reverse=True))
            self._free.sort(reverse=True)
            self._cond.notify_all()

    def offset(self, page: int, row: int = 0) -> int:
        return page * self.page_bytes + row * self.row_bytes

    def gather(self, table: list[int], num_tokens: int) -> torch.Tensor:
        """Rows ``0..num_tokens`` of a block table as one (copied) tensor."""
        if num_tokens == 0:
            return self.pages.new_zeros(0, *self.pages.shape[2:])
        used = table[: self.pages_for(num_tokens)]
        return self.pages[torch.tensor(used)].flatten(0, 1)[:num_tokens]

    def gather_batch(self, tables: Sequence[list[int]], lens: Sequence[int]) -> torch.Tensor:
        """Rows ``0..lens[i]`` of each block table, padded into one tensor in one indexing
        copy: ``[B, L, 2, kv_heads, head_dim]`` with ``L`` ≥ every length (whole pages); rows
        past a sequence's length hold other data and must not be read."""
        counts = [self.pages_for(n) for n in lens]
        width = max(1, *counts)
        index = [
            t[:c] + [t[0] if t else 0] * (width - c) for t, c in zip(tables, counts, strict=True)
        ]
        flat = torch.tensor(index).flatten()  # index_select: ≈ 2x advanced indexing's speed
        pages = torch.index_select(self.pages, 0, flat)  # [B · width, page_tokens, 2, kvh, hd]
        return pages.view(len(tables), width * self.page_tokens, *self.pages.shape[2:])

    def scatter(self, table: list[int], start: int, kv: torch.Tensor) -> None:
        """Write ``kv`` as rows ``start..`` of a block table."""
        t, done = start, 0
        while done < kv.shape[0]:
            p, r = divmod(t, self.page_tokens)
            n = min(self.page_tokens - r, kv.shape[0] - done)
            self.pages[table[p], r : r + n] = kv[done : done + n]
            t, done = t + n, done + n

    def close(self) -> None:
        self.pages = self.pages.new_zeros(0, *self.pages.shape[1:])


class PagedKV:
    """``model.BatchKV`` over an ``HbmPool``: sequence ``i``'s layer-``l`` KV is in the pages
    ``tables(l)[i]``, ``past_lens[i]`` rows cached. ``before(layer)`` runs first (a PE waits
    there for the layer's Layer Blocks), ``after(layer)`` once the new KV is in its pages (a PE
    hands the layer to its sender)."""

    def __init__(
        self,
        pool: HbmPool,
        tables: Callable[[int], Sequence[list[int]]],
        past_lens: Sequence[int],
        before: Callable[[int], None] | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        self.pool = pool
        self.tables = tables
        self.past_lens = list(past_lens)
        self.before = before
        self.after = after

    def update(self, layer: int, new_kv: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
        if self.before is not None:
            self.before(layer)
        tables = self.tables(layer)
        new_kv = new_kv.to("cpu")  # the pool is host memory (no copy on the CPU)
        start = 0
        for table, p, t in zip(tables, self.past_lens, lens, strict=True):
            self.pool.scatter(table, p, new_kv[start : start + t])
            start += t
        full = self.pool.gather_batch(
            tables, [p + t for p, t in zip(self.past_lens, lens, strict=True)]
        )
        if self.after is not None:
            self.after(layer)
        return full
