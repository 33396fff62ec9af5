"""Engine, node and group ids of a cluster (design §2, §13.1): the one layout every shell uses.

Ids only: no network resources, no paths, no processes (the simulator's ``Fabric`` adds
resources and paths on top; the runtime maps ids to processes, the vLLM shell to instances).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath.config import Config
from dualpath.types import EngineKind


@dataclass(frozen=True, slots=True)
class Topology:
    """Prefill nodes are ``0..P-1``, decode nodes ``P..P+D-1``; engine ``e`` lives on node
    ``e // g`` (PEs and DEs share one id space, PEs first).

    ``prefill_ep`` / ``decode_ep``: the engines of a group share one EP model instance;
    otherwise each engine holds its own copy (data parallel). ``prefill_group_nodes`` /
    ``decode_group_nodes``: nodes per engine group (1 without EP). A group's id is the id of
    its first node.
    """

    gpus_per_node: int
    num_prefill_nodes: int
    num_decode_nodes: int
    prefill_ep: bool = False
    decode_ep: bool = False
    prefill_group_nodes: int = 1
    decode_group_nodes: int = 1
    pe_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    de_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    engine_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _group_of_node: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        g, p, d = self.gpus_per_node, self.num_prefill_nodes, self.num_decode_nodes
        for name, per, nodes in (
            ("prefill_group_nodes", self.prefill_group_nodes, p),
            ("decode_group_nodes", self.decode_group_nodes, d),
        ):
            if not (per >= 1 and nodes % per == 0):
                raise ValueError(f"{name}={per} is invalid: must be a divisor of {nodes}")
        groups = [n - n % self.prefill_group_nodes for n in range(p)]
        groups += [n - (n - p) % self.decode_group_nodes for n in range(p, p + d)]
        set_ = object.__setattr__  # derived ids, computed once (the dataclass is frozen)
        set_(self, "pe_ids", tuple(range(p * g)))
        set_(self, "de_ids", tuple(range(p * g, (p + d) * g)))
        set_(self, "engine_ids", tuple(range((p + d) * g)))
        set_(self, "_group_of_node", tuple(groups))

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
    def prefill_group_gpus(self) -> int:
        """GPUs of a PE group (they run their forward passes in lockstep)."""
        return self.prefill_group_nodes * self.gpus_per_node

    @property
    def decode_group_gpus(self) -> int:
        return self.decode_group_nodes * self.gpus_per_node

    @property
    def decode_ep_gpus(self) -> int:
        """GPUs one DE's share of the model weights is spread over: its EP group's size
        with EP, else 1 (each DE holds the whole model)."""
        return self.decode_group_gpus if self.decode_ep else 1

    def node_of(self, engine: int) -> int:
        return engine // self.gpus_per_node

    def is_pe(self, engine: int) -> bool:
        return engine < len(self.pe_ids)

    def kind_of(self, engine: int) -> EngineKind:
        return EngineKind.PE if engine < len(self.pe_ids) else EngineKind.DE

    def kind_of_node(self, node: int) -> EngineKind:
        return EngineKind.PE if node < self.num_prefill_nodes else EngineKind.DE

    def group_of(self, engine: int) -> int:
        return self._group_of_node[engine // self.gpus_per_node]

    def group_of_node(self, node: int) -> int:
        return self._group_of_node[node]

    def groups(self, kind: EngineKind) -> list[tuple[int, tuple[int, ...]]]:
        """``(group_id, member engine ids)`` of one kind, sorted by group id."""
        ids = self.pe_ids if kind is EngineKind.PE else self.de_ids
        out: dict[int, list[int]] = {}
        for e in ids:
            out.setdefault(self.group_of(e), []).append(e)
        return [(gid, tuple(out[gid])) for gid in sorted(out)]

    def engine_name(self, engine: int) -> str:
        return f"{self.kind_of(engine).value}{engine}@node{self.node_of(engine)}"
