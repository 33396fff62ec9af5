"""Shared helpers for runtime tests: a small 1P1D config and reference (recomputed) outputs.

Without torch none of them is collected (the KV machinery's own tests, which need no torch,
are ``tests/kv/``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath.config import Config, preset

if TYPE_CHECKING:
    from dualpath.workload.scripts import AgentScript


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Skip collecting the runtime tests when torch is not installed."""
    if not collection_path.name.startswith("test_"):
        return None
    try:
        if importlib.util.find_spec("torch") is not None:
            return None
    except ValueError:  # sys.modules["torch"] is None: torch is blocked
        pass
    return True


def small_config(gpus_per_node: int = 1, snic_bytes_per_s: float = 400e6) -> Config:
    cfg = preset("tiny-1p1d")
    hw = replace(cfg.hardware, gpus_per_node=gpus_per_node, snic_bytes_per_s=snic_bytes_per_s)
    return replace(cfg, hardware=hw)


def reference_outputs(
    cfg: Config, agents: Sequence[AgentScript], seed: int = 0
) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Recompute from scratch: each turn's greedy tokens over the whole prompt."""
    import torch

    from dualpath.runtime.model import greedy_generate
    from dualpath.runtime.tiny import TinyTransformer

    torch.set_num_threads(1)
    model = TinyTransformer(cfg.model, seed=seed)
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for a in agents:
        context: tuple[int, ...] = ()
        turns = []
        for append, n in zip(a.appends, a.outputs, strict=True):
            prompt = (*context, *append)
            gen, _ = greedy_generate(model, prompt, n)
            turns.append(tuple(gen))
            context = (*prompt, *gen)
        out[a.agent_id] = tuple(turns)
    return out


def assert_no_processes(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie of an already-joined child cannot exist: joined processes are reaped
        raise AssertionError(f"process {pid} outlived the runtime")


def replay_ledger_log(config: Config, path: Path) -> int:
    """Feed a runtime's ledger journal (``Scheduler.record_ledger``, JSON lines) to a fresh
    ledger and policy; ``replay`` raises at the first view or decision that differs.

    Covers both kinds of decision: assignments (``schedule``, on the replayed view) and PE
    forward plans (``plan_forward``). Returns the number of assignments and forward chunks
    compared (STYLE §1: one policy core, two shells)."""
    from dualpath.ledger import Topology, replay
    from dualpath.policy import make_policy

    records = [json.loads(line) for line in path.read_text().splitlines()]
    stats = replay(records, Topology.from_config(config), make_policy(config))
    return stats.assignments + stats.chunks
