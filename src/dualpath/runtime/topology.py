"""Engine and node ids of the emulated cluster (same layout as the simulator's, SPEC §2).

Prefill nodes are ``0..P-1``, decode nodes ``P..P+D-1``; engine ``e`` lives on node ``e // g``.
Group ids: an EP group takes the id of its first node (``cluster.*_ep_nodes`` nodes per group,
default all nodes of the kind); otherwise each node is a group.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import Config
from dualpath.types import EngineKind


@dataclass(frozen=True, slots=True)
class Topology:
    gpus_per_node: int
    num_prefill_nodes: int
    num_decode_nodes: int
    prefill_ep: bool
    decode_ep: bool
    prefill_group_nodes: int = 0  # nodes per EP group; 0: all nodes of the kind (with EP)
    decode_group_nodes: int = 0

    @classmethod
    def from_config(cls, config: Config) -> Topology:
        cl = config.cluster
        return cls(
            config.hardware.gpus_per_node,
            cl.num_prefill_nodes,
            cl.num_decode_nodes,
            cl.prefill_ep,
            cl.decode_ep,
            cl.prefill_group_nodes,
            cl.decode_group_nodes,
        )

    @property
    def num_nodes(self) -> int:
        return self.num_prefill_nodes + self.num_decode_nodes

    @property
    def pe_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_prefill_nodes * self.gpus_per_node))

    @property
    def de_ids(self) -> tuple[int, ...]:
        return tuple(range(len(self.pe_ids), self.num_nodes * self.gpus_per_node))

    @property
    def engine_ids(self) -> tuple[int, ...]:
        return self.pe_ids + self.de_ids

    def node_of(self, engine: int) -> int:
        return engine // self.gpus_per_node

    def is_pe(self, engine: int) -> bool:
        return engine < len(self.pe_ids)

    def kind_of(self, engine: int) -> EngineKind:
        return EngineKind.PE if self.is_pe(engine) else EngineKind.DE

    def node_kind(self, node: int) -> EngineKind:
        return EngineKind.PE if node < self.num_prefill_nodes else EngineKind.DE

    def group_nodes(self, kind: EngineKind) -> int:
        """Nodes per group of ``kind`` (1 without EP)."""
        if kind is EngineKind.PE:
            ep, per, nodes = self.prefill_ep, self.prefill_group_nodes, self.num_prefill_nodes
        else:
            ep, per, nodes = self.decode_ep, self.decode_group_nodes, self.num_decode_nodes
        return (per or nodes) if ep else 1

    def group_of(self, engine: int) -> int:
        node = self.node_of(engine)
        if self.is_pe(engine):
            return node - node % self.group_nodes(EngineKind.PE)
        return node - (node - self.num_prefill_nodes) % self.group_nodes(EngineKind.DE)

    def engine_name(self, engine: int) -> str:
        return f"{self.kind_of(engine).value}{engine}@node{self.node_of(engine)}"
