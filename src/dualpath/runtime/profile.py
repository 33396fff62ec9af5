"""Short profiling of this host: the engines' own prefill passes and decode steps.

Runs the model the engines run (``TinyTransformer``, same config and seed) in this process,
with one intra-op thread like an engine, over the engines' data path: KV in a paged
``HbmPool``, each layer's past gathered from its pages and the new KV scattered back, every
pass one ``forward_batch`` (batches of prefill chunks; batched decode steps). It also times
a large memory copy (the host's memory bandwidth, what a weight read costs). Each figure is
the best of ``repeats``. The samples feed ``dualpath.models.calibrate``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dualpath.config import ModelConfig
from dualpath.models.calibrate import DecodeSample, PrefillSample
from dualpath.runtime.decode_kv import DecodeKV
from dualpath.runtime.hbm import HbmPool, PagedKV
from dualpath.runtime.model import CacheBatch, KVCache
from dualpath.runtime.tiny import TinyTransformer

# (cached, new, batch): single chunks over the sizes the bench's turns have, and batches
PREFILL_GRID = (
    (0, 64, 1),
    (0, 256, 1),
    (0, 512, 1),
    (512, 64, 1),
    (1024, 128, 1),
    (2048, 64, 1),
    (2048, 256, 1),
    (1024, 64, 4),
    (2048, 32, 8),
)
# (context per sequence, batch): a DE's batched step at the contexts and batches it runs
DECODE_GRID = ((256, 1), (1024, 1), (2048, 1), (256, 4), (1024, 4), (2048, 4), (1024, 8), (2048, 8))
COPY_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class HostProfile:
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    memory_bytes_per_s: float  # bytes moved (read + written) per second by a large copy


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bytes_per_s(repeats: int = 5) -> float:
    """Read + write bytes per second of a ``COPY_BYTES`` tensor copy (one thread)."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    return 2 * COPY_BYTES / _best_of(repeats, copy)


def profile_host(
    model_cfg: ModelConfig,
    block_tokens: int,
    weight_seed: int = 0,
    prefill_grid: Sequence[tuple[int, int, int]] = PREFILL_GRID,
    decode_grid: Sequence[tuple[int, int]] = DECODE_GRID,
    repeats: int = 3,
) -> HostProfile:
    """Prefill and decode samples and the copy bandwidth, measured on this host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        model = TinyTransformer(model_cfg, seed=weight_seed)
        layers = model_cfg.num_layers
        need = [b * (c + n) for c, n, b in prefill_grid] + [b * (c + 1) for c, b in decode_grid]
        pages = -(-max(need) // block_tokens) + max(b for *_, b in prefill_grid) + 8
        pool = HbmPool(pages * layers, block_tokens, model_cfg.num_kv_heads, model_cfg.head_dim)

        with torch.no_grad():
            warm = CacheBatch([KVCache(model, 2), KVCache(model, 2)])
            model.forward_batch([[0], [0, 1]], warm)  # warm-up
            pre = [
                PrefillSample(c, n, _measure(pool, model, layers, c, n, b, repeats), b)
                for c, n, b in prefill_grid
            ]
            dec = [
                DecodeSample(c, _measure(pool, model, layers, c, 1, b, repeats), b)
                for c, b in decode_grid
            ]
            bandwidth = memory_bytes_per_s()
        return HostProfile(pre, dec, bandwidth)
    finally:
        torch.set_num_threads(threads)


def _measure(
    pool: HbmPool,
    model: TinyTransformer,
    layers: int,
    cached: int,
    new: int,
    batch: int,
    repeats: int,
) -> float:
    """Best-of-``repeats`` seconds of one engine pass: ``batch`` sequences of ``new`` tokens
    after ``cached``, new KV scattered into pool pages; a prefill's pasts gathered from the
    pages (``PagedKV``, as a PE), a decode step's read where a DE keeps them between steps
    (``DecodeKV``, arranged before the timing: a DE copies a request in once)."""
    per = pool.pages_for(cached + new)
    tables = []
    for _ in range(layers):
        row = []
        for _ in range(batch):
            got = pool.alloc(per)
            if got is None:
                raise RuntimeError("profile pool too small (a bug in its sizing)")
            row.append(got)
        tables.append(row)
    vocab = model.vocab_size
    tokens = [[(i * 7 + t) % vocab for t in range(new)] for i in range(batch)]

    def run() -> None:
        model.forward_batch(tokens, PagedKV(pool, lambda layer: tables[layer], [cached] * batch))

    if new == 1:  # a decode step
        keep = DecodeKV(pool, layers, model.device, model.dtype)
        seqs = list(range(batch))
        per_seq = [[tables[layer][i] for layer in range(layers)] for i in seqs]
        keep.arrange(seqs, per_seq, [cached] * batch)

        def run() -> None:
            model.forward_batch(tokens, keep.batch(per_seq, [cached] * batch))

    try:
        return _best_of(repeats, run)
    finally:
        for row in tables:
            for t in row:
                pool.free(t)
