"""Engine, node and group ids: one layout for the simulator and the runtime (design §2, §13.1)."""

from __future__ import annotations

import pytest

from dualpath.config import apply_overrides, preset
from dualpath.ledger import Topology
from dualpath.types import EngineKind


def _topo(name: str = "ds660b-2p4d", *overrides: str) -> Topology:
    return Topology.from_config(apply_overrides(preset(name), list(overrides)))


def test_ids_and_ep_groups() -> None:
    topo = _topo()
    assert topo.pe_ids == tuple(range(16)) and topo.de_ids == tuple(range(16, 48))
    assert topo.node_of(15) == 1 and topo.node_of(16) == 2
    assert topo.groups(EngineKind.PE) == [(0, topo.pe_ids)]  # EP16 prefill
    assert topo.groups(EngineKind.DE) == [(2, topo.de_ids)]  # EP32 decode
    assert topo.decode_ep_gpus == 32
    assert topo.engine_name(16) == "de16@node2"


def test_ep_groups_of_a_few_nodes_tile_a_paper_scale_cluster() -> None:
    """48P96D as 24 replicas of the 2P4D unit: EP16 prefill groups, EP32 decode groups."""
    topo = _topo("ds660b-48p96d")
    assert len(topo.engine_ids) == 1152
    pe_groups, de_groups = topo.groups(EngineKind.PE), topo.groups(EngineKind.DE)
    assert [gid for gid, _ in pe_groups] == list(range(0, 48, 2))
    assert [gid for gid, _ in de_groups] == list(range(48, 144, 4))
    assert all(len(m) == 16 for _, m in pe_groups) and all(len(m) == 32 for _, m in de_groups)
    assert pe_groups[1][1] == tuple(range(16, 32)) and topo.group_of(8 * 48 + 33) == 52
    assert topo.prefill_group_gpus == 16 and topo.decode_group_gpus == 32


def test_groups_are_nodes_without_ep() -> None:
    topo = _topo("qwen32b-1p2d")
    assert [gid for gid, _ in topo.groups(EngineKind.DE)] == [1, 2]
    assert topo.group_of(0) == 0 and topo.group_of(17) == 2
    assert topo.decode_ep_gpus == 1  # data parallel: every DE holds the whole model


def test_tiny_layout() -> None:
    topo = _topo("tiny-1p1d")
    assert topo.pe_ids == (0, 1) and topo.de_ids == (2, 3)
    assert [topo.node_of(e) for e in topo.engine_ids] == [0, 0, 1, 1]
    assert topo.kind_of(2) is EngineKind.DE and topo.kind_of_node(0) is EngineKind.PE
    assert [topo.group_of(e) for e in topo.engine_ids] == [0, 0, 1, 1]


def test_ep_nodes_need_ep() -> None:
    with pytest.raises(
        ValueError, match=r"cluster\.prefill_ep_nodes=1 is invalid: must be 0 unless"
    ):
        _topo("qwen32b-1p2d", "cluster.prefill_ep_nodes=1")


def test_group_sizes_must_tile_the_nodes() -> None:
    with pytest.raises(ValueError, match="decode_group_nodes=3 is invalid"):
        Topology(8, 2, 4, True, True, 2, 3)
