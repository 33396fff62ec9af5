"""Short profiling of this host: the runtime model's prefill and decode step times.

Runs the same model the engines run (``TinyTransformer``, same config and seed) in this
process, one thread like an engine, and times prefill of ``new`` tokens after ``cached``
ones and single-token decode steps at several contexts (best of ``repeats``). The samples
feed ``dualpath.models.calibrate``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

from dualpath.config import ModelConfig
from dualpath.models.calibrate import DecodeSample, PrefillSample
from dualpath.runtime.model import KVCache, TinyTransformer

PREFILL_GRID = ((0, 64), (0, 256), (0, 512), (512, 64), (1024, 128), (2048, 64), (2048, 256))
DECODE_CONTEXTS = (256, 1024, 2048, 4096)


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_model(
    model_cfg: ModelConfig,
    weight_seed: int = 0,
    prefill_grid: Sequence[tuple[int, int]] = PREFILL_GRID,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
    repeats: int = 3,
) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """(prefill samples, decode samples) measured on this host with one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        model = TinyTransformer(model_cfg, seed=weight_seed)
        longest = max([c + n for c, n in prefill_grid] + [c + 1 for c in decode_contexts])
        tokens = [i % model_cfg.vocab_size for i in range(longest)]
        cache = KVCache(model, longest)
        cache.extend(model, tokens[: max(1, longest - 1)])  # KV for every prefix we need
        full = cache.length

        def step(cached: int, new: int) -> Callable[[], None]:
            def run() -> None:
                cache.length = cached
                cache.extend(model, tokens[cached : cached + new])
                cache.length = full

            return run

        with torch.no_grad():
            step(0, 8)()  # warm-up
            pre = [PrefillSample(c, n, _best_of(repeats, step(c, n))) for c, n in prefill_grid]
            dec = [DecodeSample(c, _best_of(repeats, step(c, 1))) for c in decode_contexts]
        return pre, dec
    finally:
        torch.set_num_threads(threads)
