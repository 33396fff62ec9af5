"""Opt-in timestamps of a request's hops through the runtime and its server, for the latency
breakdown (``benchmarks/bench_latency.py``, docs/runtime.md "Where a request's time goes").

Off unless ``DUALPATH_HOPS`` names a directory when a process starts (spawned children inherit
it): then ``hop(name, rid)`` appends ``<monotonic s> <name> <rid>`` to ``hops-<pid>.txt``
there. ``time.monotonic`` is one clock for every process of a host (CLOCK_MONOTONIC), so the
files of the HTTP process, the scheduler, the storage workers and the engines merge into one
timeline. Off, a hop is one global test: nothing is measured that a run does not ask for.
"""

from __future__ import annotations

import os
import time
from typing import TextIO

ENV = "DUALPATH_HOPS"
_dir = os.environ.get(ENV) or None
_file: TextIO | None = None
_pid = -1


def enabled() -> bool:
    return _dir is not None


def hop(name: str, rid: int = -1) -> None:
    """Record that request ``rid`` (-1: not known here) passed ``name`` now."""
    global _file, _pid
    if _dir is None:
        return
    t = time.monotonic()
    if _file is None or _pid != os.getpid():  # (a fork gets its own file)
        _pid = os.getpid()
        _file = open(os.path.join(_dir, f"hops-{_pid}.txt"), "a", buffering=1)  # noqa: SIM115
    _file.write(f"{t:.6f} {name} {rid}\n")


def read(directory: str) -> list[tuple[float, str, int]]:
    """Every hop recorded under ``directory``, in time order."""
    out: list[tuple[float, str, int]] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("hops-") and name.endswith(".txt"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    t, hop_name, rid = line.split()
                    out.append((float(t), hop_name, int(rid)))
    out.sort()
    return out
