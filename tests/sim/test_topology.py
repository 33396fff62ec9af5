"""Ids, groups and transfer paths of the simulated cluster (SPEC §2, §4–§6, §13.1)."""

from __future__ import annotations

import pytest

from dualpath.config import apply_overrides, preset
from dualpath.config.sim import SimConfig, parse_systems
from dualpath.sim.events import EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.systems import config_for, system_spec
from dualpath.sim.topology import Topology
from dualpath.types import EngineKind


def _topo(name: str = "ds660b-2p4d", *overrides: str) -> tuple[Topology, FluidNetwork]:
    net = FluidNetwork(EventLoop())
    return Topology(apply_overrides(preset(name), list(overrides)), net.add_resource), net


def test_ids_and_ep_groups() -> None:
    topo, net = _topo()
    assert topo.pe_ids == tuple(range(16)) and topo.de_ids == tuple(range(16, 48))
    assert topo.node_of(15) == 1 and topo.node_of(16) == 2
    assert topo.groups(EngineKind.PE) == [(0, topo.pe_ids)]  # EP16 prefill
    assert topo.groups(EngineKind.DE) == [(2, topo.de_ids)]  # EP32 decode
    assert net.num_resources == 6 * 3 + 48 * 2
    assert net.capacity(topo.dram[0]) == 500e9 and net.capacity(topo.tx[3]) == 50e9


def test_ep_groups_of_a_few_nodes_tile_a_paper_scale_cluster() -> None:
    """48P96D as 24 replicas of the 2P4D unit: EP16 prefill groups, EP32 decode groups."""
    topo, net = _topo(
        "ds660b-2p4d",
        "cluster.num_prefill_nodes=48",
        "cluster.num_decode_nodes=96",
        "cluster.prefill_ep_nodes=2",
        "cluster.decode_ep_nodes=4",
    )
    assert len(topo.pe_ids) + len(topo.de_ids) == 1152
    pe_groups, de_groups = topo.groups(EngineKind.PE), topo.groups(EngineKind.DE)
    assert [gid for gid, _ in pe_groups] == list(range(0, 48, 2))
    assert [gid for gid, _ in de_groups] == list(range(48, 144, 4))
    assert all(len(m) == 16 for _, m in pe_groups) and all(len(m) == 32 for _, m in de_groups)
    assert pe_groups[1][1] == tuple(range(16, 32)) and topo.group_of(8 * 48 + 33) == 52
    assert topo.prefill_group_gpus == 16 and topo.decode_group_gpus == 32
    assert net.num_resources == 144 * 3 + 1152 * 2


def test_ep_nodes_need_ep() -> None:
    with pytest.raises(
        ValueError, match=r"cluster\.prefill_ep_nodes=1 is invalid: must be 0 unless"
    ):
        _topo("qwen32b-1p2d", "cluster.prefill_ep_nodes=1")


def test_groups_are_nodes_without_ep() -> None:
    topo, _ = _topo("qwen32b-1p2d")
    assert [gid for gid, _ in topo.groups(EngineKind.DE)] == [1, 2]
    assert topo.group_of(0) == 0 and topo.group_of(17) == 2


def test_paths_cross_the_resources_of_spec_4() -> None:
    topo, _ = _topo()
    pe, de = 3, 40
    de_node = topo.node_of(de)
    assert topo.read_path(0) == (topo.snic_read[0], topo.dram[0])
    assert topo.pe_load_path(pe) == (topo.dram[0], topo.tx[pe], topo.rx[pe])  # loopback
    rail = de_node * 8 + pe % 8  # DE-node CNIC on the PE's rail (GPU index 3)
    assert rail == 43
    assert topo.de_load_path(de, pe) == (topo.dram[de_node], topo.tx[rail], topo.rx[pe])
    assert topo.send_path(pe, de) == (topo.tx[pe], topo.rx[rail], topo.dram[de_node])
    assert topo.h2d_path(de) == (topo.dram[de_node], topo.tx[de], topo.rx[de])
    assert topo.persist_path(de_node) == (topo.dram[de_node], topo.snic_write[de_node])
    assert len(topo.collective_path(topo.pe_ids)) == 32


def test_without_rail_matching_the_de_uses_its_own_cnic() -> None:
    net = FluidNetwork(EventLoop())
    topo = Topology(preset("ds660b-2p4d"), net.add_resource, rail_matched=False)
    assert topo.de_load_path(40, 3) == (topo.dram[5], topo.tx[40], topo.rx[3])
    assert topo.send_path(3, 40) == (topo.tx[3], topo.rx[40], topo.dram[5])


def test_storage_limit_adds_a_shared_resource() -> None:
    topo, net = _topo("ds27b-1p1d", "hardware.storage_read_bytes_per_s=60e9")
    assert topo.storage is not None
    assert topo.read_path(1)[0] == topo.storage
    assert net.capacity(topo.storage) == 60e9


def test_systems_map_to_policies() -> None:
    expected = {
        "basic": ("basic", False, False),
        "layer": ("basic", True, False),
        "dpl": ("dpl", True, False),
        "dualpath": ("dualpath", True, False),
        "oracle": ("dualpath", True, True),
    }
    for name, (policy, layerwise, oracle) in expected.items():
        spec = system_spec(name)
        assert (spec.policy, spec.layerwise, spec.oracle) == (policy, layerwise, oracle)
        assert config_for(preset(), spec).scheduler.policy == policy


def test_bad_names_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError, match="system='fast'"):
        system_spec("fast")
    with pytest.raises(ValueError, match=r"sim\.systems"):
        parse_systems("basic,nope")
    with pytest.raises(ValueError, match=r"sim\.systems"):
        parse_systems("basic,basic")
    with pytest.raises(ValueError, match=r"sim\.reads_per_node"):
        SimConfig(reads_per_node=0)
    assert parse_systems(" Basic, oracle ") == ("basic", "oracle")
