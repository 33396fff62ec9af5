"""Busy-loop processes beside a measurement: another job's CPU use, on demand.

``dualpath validate --background-load N`` and ``benchmarks/bench_runtime.py
--background-load`` use it to show that the emulated testbed's verdict does not depend on
how busy the host is (docs/runtime.md, "Emulated GPU time").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _spin() -> None:
    while True:
        pass


@contextmanager
def background_load(n: int) -> Iterator[None]:
    """``n`` busy-loop processes (spawned, killed on exit) for the duration of the block."""
    if n < 0:
        raise ValueError(f"--background-load {n} is invalid: must be >= 0")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        if procs:
            time.sleep(1.0)  # let the loops start
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)


def load_average() -> str:
    """The host's load average, to print beside a timing."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) / {five:.2f} (5 min)"
