"""Cluster topology: node, engine and group ids, network resources, and the path of each transfer.

Owns the id layout (SPEC §2, §13.1) and the resource list of the fluid network; holds no
request state. Paths follow SPEC §4–§6: all traffic into or out of a GPU crosses its CNIC.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath.config import Config
from dualpath.types import EngineKind


class Topology:
    """Prefill nodes are ``0..P-1``, decode nodes ``P..P+D-1``; engine ``e`` lives on node
    ``e // g`` (PEs and DEs share one id space). Group ids: an EP group takes the id of its
    first node (``cluster.*_ep_nodes`` nodes per group, default all nodes of the kind);
    without EP each node is a group (its id is the node id).

    Resources per node: SNIC read, SNIC write (s·B each), DRAM (M, half duplex); per engine:
    CNIC ``tx`` (reads local memory and sends) and ``rx`` (writes local memory), B each.
    """

    def __init__(
        self,
        config: Config,
        add_resource: Callable[[str, float], int],
        rail_matched: bool = True,
    ) -> None:
        hw = config.hardware
        cl = config.cluster
        self.gpus_per_node = g = hw.gpus_per_node
        self.num_prefill_nodes = p = cl.num_prefill_nodes
        self.num_decode_nodes = d = cl.num_decode_nodes
        self.num_nodes = p + d
        self.pe_ids = tuple(range(p * g))
        self.de_ids = tuple(range(p * g, (p + d) * g))
        self.engine_ids = self.pe_ids + self.de_ids
        self.rail_matched = rail_matched
        self.prefill_ep = cl.prefill_ep
        self.decode_ep = cl.decode_ep
        self.prefill_group_gpus = cl.prefill_group_nodes * g  # EP size of a PE group
        self.decode_group_gpus = cl.decode_group_nodes * g
        self._group_of_node = [cl.group_of_node(n) for n in range(p + d)]
        add = add_resource  # FluidNetwork.add_resource
        self.storage: int | None = None
        if hw.storage_read_bytes_per_s > 0:
            self.storage = add("storage.read", hw.storage_read_bytes_per_s)
        self.snic_read: list[int] = []
        self.snic_write: list[int] = []
        self.dram: list[int] = []
        for n in range(self.num_nodes):
            self.snic_read.append(add(f"node{n}.snic_read", hw.snic_total_bytes_per_s))
            self.snic_write.append(add(f"node{n}.snic_write", hw.snic_total_bytes_per_s))
            self.dram.append(add(f"node{n}.dram", hw.dram_bytes_per_s))
        self.tx: list[int] = []
        self.rx: list[int] = []
        for e in self.engine_ids:
            self.tx.append(add(f"gpu{e}.cnic_tx", hw.cnic_bytes_per_s))
            self.rx.append(add(f"gpu{e}.cnic_rx", hw.cnic_bytes_per_s))

    # ------------------------------------------------------------------ ids
    def node_of(self, engine: int) -> int:
        return engine // self.gpus_per_node

    def kind_of_node(self, node: int) -> EngineKind:
        return EngineKind.PE if node < self.num_prefill_nodes else EngineKind.DE

    def is_pe(self, engine: int) -> bool:
        return engine < len(self.pe_ids)

    def group_of(self, engine: int) -> int:
        return self._group_of_node[self.node_of(engine)]

    def groups(self, kind: EngineKind) -> list[tuple[int, tuple[int, ...]]]:
        """``(group_id, member engine ids)`` of one kind, sorted by group id."""
        ids = self.pe_ids if kind is EngineKind.PE else self.de_ids
        out: dict[int, list[int]] = {}
        for e in ids:
            out.setdefault(self.group_of(e), []).append(e)
        return [(gid, tuple(out[gid])) for gid in sorted(out)]

    # ------------------------------------------------------------------ paths (SPEC §4–§6)
    def read_path(self, node: int) -> tuple[int, ...]:
        """Storage → node SNIC (read direction) → node DRAM (PE or DE buffer)."""
        path = (self.snic_read[node], self.dram[node])
        return path if self.storage is None else (self.storage, *path)

    def pe_load_path(self, pe: int) -> tuple[int, ...]:
        """PE buffer → PE HBM: loopback RDMA through the PE's CNIC (tx and rx)."""
        return (self.dram[self.node_of(pe)], self.tx[pe], self.rx[pe])

    def de_cnic(self, de: int, pe: int) -> int:
        """The DE-node CNIC that exchanges DE-buffer KV with ``pe``. The DE buffer is host
        DRAM, reachable from every CNIC of the node; rail-matched (default) it is the CNIC on
        ``pe``'s rail (same GPU index), else ``de``'s own CNIC."""
        if not self.rail_matched:
            return de
        g = self.gpus_per_node
        return self.node_of(de) * g + pe % g

    def de_load_path(self, de: int, pe: int) -> tuple[int, ...]:
        """DE buffer → DE-node CNIC → compute network → PE CNIC → PE HBM."""
        return (self.dram[self.node_of(de)], self.tx[self.de_cnic(de, pe)], self.rx[pe])

    def send_path(self, pe: int, de: int) -> tuple[int, ...]:
        """PE HBM → PE CNIC → DE-node CNIC → DE buffer (DRAM)."""
        return (self.tx[pe], self.rx[self.de_cnic(de, pe)], self.dram[self.node_of(de)])

    def h2d_path(self, de: int) -> tuple[int, ...]:
        """DE buffer → DE HBM: loopback through the DE's CNIC."""
        return (self.dram[self.node_of(de)], self.tx[de], self.rx[de])

    def persist_path(self, node: int) -> tuple[int, ...]:
        """Decode node DRAM → its SNIC (write direction) → storage."""
        return (self.dram[node], self.snic_write[node])

    def collective_path(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """All CNICs of an EP group, both directions: one all-to-all burst as one flow."""
        return tuple(self.tx[e] for e in members) + tuple(self.rx[e] for e in members)
