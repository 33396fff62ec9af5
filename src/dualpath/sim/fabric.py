"""The simulated cluster's network: fluid resources and the path of each transfer.

Owns the resource list of the fluid network (ids come from ``dualpath.ledger.Topology``);
holds no request state. Paths follow design §4–§6: all traffic into or out of a GPU crosses its
CNIC.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.config import HardwareConfig
from dualpath.ledger import Topology


class Fabric:
    """Resources per node: SNIC read, SNIC write (s·B each), DRAM (M, half duplex); per engine:
    CNIC ``tx`` (reads local memory and sends) and ``rx`` (writes local memory), B each.
    """

    def __init__(
        self,
        topology: Topology,
        hw: HardwareConfig,
        add_resource: Callable[[str, float], int],
        rail_matched: bool = True,
    ) -> None:
        self.topology = topology
        self.rail_matched = rail_matched
        self._gpus_per_node = topology.gpus_per_node
        add = add_resource  # FluidNetwork.add_resource
        self.storage: int | None = None
        if hw.storage_read_bytes_per_s > 0:
            self.storage = add("storage.read", hw.storage_read_bytes_per_s)
        self.snic_read: list[int] = []
        self.snic_write: list[int] = []
        self.dram: list[int] = []
        for n in range(topology.num_nodes):
            self.snic_read.append(add(f"node{n}.snic_read", hw.snic_total_bytes_per_s))
            self.snic_write.append(add(f"node{n}.snic_write", hw.snic_total_bytes_per_s))
            self.dram.append(add(f"node{n}.dram", hw.dram_bytes_per_s))
        self.tx: list[int] = []
        self.rx: list[int] = []
        for e in topology.engine_ids:
            self.tx.append(add(f"gpu{e}.cnic_tx", hw.cnic_bytes_per_s))
            self.rx.append(add(f"gpu{e}.cnic_rx", hw.cnic_bytes_per_s))

    def _node(self, engine: int) -> int:
        return engine // self._gpus_per_node

    # ------------------------------------------------------------------ paths (design §4–§6)
    def read_path(self, node: int) -> tuple[int, ...]:
        """Storage → node SNIC (read direction) → node DRAM (PE or DE buffer)."""
        path = (self.snic_read[node], self.dram[node])
        return path if self.storage is None else (self.storage, *path)

    def pe_load_path(self, pe: int) -> tuple[int, ...]:
        """PE buffer → PE HBM: loopback RDMA through the PE's CNIC (tx and rx)."""
        return (self.dram[self._node(pe)], self.tx[pe], self.rx[pe])

    def de_cnic(self, de: int, pe: int) -> int:
        """The DE-node CNIC that exchanges DE-buffer KV with ``pe``. The DE buffer is host
        DRAM, reachable from every CNIC of the node; rail-matched (default) it is the CNIC on
        ``pe``'s rail (same GPU index), else ``de``'s own CNIC."""
        if not self.rail_matched:
            return de
        g = self._gpus_per_node
        return self._node(de) * g + pe % g

    def de_load_path(self, de: int, pe: int) -> tuple[int, ...]:
        """DE buffer → DE-node CNIC → compute network → PE CNIC → PE HBM."""
        return (self.dram[self._node(de)], self.tx[self.de_cnic(de, pe)], self.rx[pe])

    def send_path(self, pe: int, de: int) -> tuple[int, ...]:
        """PE HBM → PE CNIC → DE-node CNIC → DE buffer (DRAM)."""
        return (self.tx[pe], self.rx[self.de_cnic(de, pe)], self.dram[self._node(de)])

    def h2d_path(self, de: int) -> tuple[int, ...]:
        """DE buffer → DE HBM: loopback through the DE's CNIC."""
        return (self.dram[self._node(de)], self.tx[de], self.rx[de])

    def persist_path(self, node: int) -> tuple[int, ...]:
        """Decode node DRAM → its SNIC (write direction) → storage."""
        return (self.dram[node], self.snic_write[node])

    def collective_path(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """All CNICs of an EP group, both directions: one all-to-all burst as one flow."""
        return tuple(self.tx[e] for e in members) + tuple(self.rx[e] for e in members)
