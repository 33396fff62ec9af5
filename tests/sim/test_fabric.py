"""Network resources and transfer paths of the simulated cluster (design §4–§6)."""

from __future__ import annotations

from dualpath.config import apply_overrides, preset
from dualpath.ledger import Topology
from dualpath.sim.events import EventLoop
from dualpath.sim.fabric import Fabric
from dualpath.sim.network import FluidNetwork


def _fabric(
    name: str = "ds660b-2p4d", *overrides: str, rail_matched: bool = True
) -> tuple[Fabric, FluidNetwork]:
    config = apply_overrides(preset(name), list(overrides))
    net = FluidNetwork(EventLoop())
    fabric = Fabric(Topology.from_config(config), config.hardware, net.add_resource, rail_matched)
    return fabric, net


def test_resources_per_node_and_engine() -> None:
    fabric, net = _fabric()
    assert net.num_resources == 6 * 3 + 48 * 2
    assert net.capacity(fabric.dram[0]) == 500e9 and net.capacity(fabric.tx[3]) == 50e9


def test_paper_scale_resources() -> None:
    _, net = _fabric(
        "ds660b-2p4d",
        "cluster.num_prefill_nodes=48",
        "cluster.num_decode_nodes=96",
        "cluster.prefill_ep_nodes=2",
        "cluster.decode_ep_nodes=4",
    )
    assert net.num_resources == 144 * 3 + 1152 * 2


def test_paths_cross_the_resources_of_spec_4() -> None:
    fabric, _ = _fabric()
    pe, de = 3, 40
    de_node = fabric.topology.node_of(de)
    f = fabric
    assert f.read_path(0) == (f.snic_read[0], f.dram[0])
    assert f.pe_load_path(pe) == (f.dram[0], f.tx[pe], f.rx[pe])  # loopback
    rail = de_node * 8 + pe % 8  # DE-node CNIC on the PE's rail (GPU index 3)
    assert rail == 43
    assert f.de_load_path(de, pe) == (f.dram[de_node], f.tx[rail], f.rx[pe])
    assert f.send_path(pe, de) == (f.tx[pe], f.rx[rail], f.dram[de_node])
    assert f.h2d_path(de) == (f.dram[de_node], f.tx[de], f.rx[de])
    assert f.persist_path(de_node) == (f.dram[de_node], f.snic_write[de_node])
    assert len(f.collective_path(f.topology.pe_ids)) == 32


def test_without_rail_matching_the_de_uses_its_own_cnic() -> None:
    f, _ = _fabric(rail_matched=False)
    assert f.de_load_path(40, 3) == (f.dram[5], f.tx[40], f.rx[3])
    assert f.send_path(3, 40) == (f.tx[3], f.rx[40], f.dram[5])


def test_storage_limit_adds_a_shared_resource() -> None:
    f, net = _fabric("ds27b-1p1d", "hardware.storage_read_bytes_per_s=60e9")
    assert f.storage is not None
    assert f.read_path(1)[0] == f.storage
    assert net.capacity(f.storage) == 60e9
