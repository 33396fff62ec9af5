"""Transfers: each flow's KV bytes counted once, in the core's ``RunCounters`` by ``KVPath``."""

from __future__ import annotations

import pytest

from dualpath.ledger import RunCounters
from dualpath.ledger.counters import SIM_PATHS
from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.transfers import COLLECTIVES, PATH_KINDS, Transfers
from dualpath.types import KVPath

GB = 1e9


def _run(oracle: bool) -> tuple[Transfers, RunCounters, list[str]]:
    loop = EventLoop()
    net = FluidNetwork(loop)
    link = net.add_resource("link", 1 * GB)
    counters = RunCounters.over(SIM_PATHS)
    transfers = Transfers(loop, net, oracle=oracle, counters=counters)
    landed: list[str] = []
    for kind, size in (
        (KVPath.STORAGE_TO_DE_BUFFER, 2 * GB),
        (KVPath.DE_BUFFER_TO_PE_HBM, 1 * GB),
        (KVPath.STORAGE_TO_DE_BUFFER, 0.5 * GB),
        (KVPath.DE_TO_STORAGE, 3 * GB),
        (COLLECTIVES, 4 * GB),
    ):
        transfers.start(kind, (link,), size, lambda k=kind: landed.append(str(k)))
    loop.run()
    return transfers, counters, landed


def test_kv_bytes_go_to_the_counters_collectives_apart() -> None:
    transfers, counters, landed = _run(oracle=False)
    assert len(landed) == 5
    assert counters.bytes_by_path[KVPath.STORAGE_TO_DE_BUFFER] == 2.5 * GB
    assert counters.bytes_by_path[KVPath.DE_BUFFER_TO_PE_HBM] == 1 * GB
    assert counters.bytes_by_path[KVPath.DE_TO_STORAGE] == 3 * GB
    assert counters.read_bytes() == 2.5 * GB
    assert transfers.collective_bytes == 4 * GB
    paths = transfers.path_bytes()
    assert list(paths) == list(PATH_KINDS) and all(type(k) is str for k in paths)
    assert paths["storage_to_de_buffer"] == 2.5 * GB and paths[COLLECTIVES] == 4 * GB
    assert transfers.flows_by_kind[KVPath.STORAGE_TO_DE_BUFFER] == 2


def test_the_oracle_moves_no_kv_bytes_but_persists_and_collects() -> None:
    transfers, counters, landed = _run(oracle=True)
    assert len(landed) == 5  # the free ones land at once, the rest take time
    assert counters.bytes_by_path[KVPath.STORAGE_TO_DE_BUFFER] == 0.0
    assert counters.bytes_by_path[KVPath.DE_BUFFER_TO_PE_HBM] == 0.0
    assert counters.bytes_by_path[KVPath.DE_TO_STORAGE] == 3 * GB
    assert transfers.collective_bytes == 4 * GB


def test_counters_without_the_simulators_paths_are_refused() -> None:
    loop = EventLoop()
    with pytest.raises(ValueError, match=r"bytes_by_path has no .*pe_buffer_to_pe_hbm"):
        Transfers(loop, FluidNetwork(loop), oracle=False, counters=RunCounters())
