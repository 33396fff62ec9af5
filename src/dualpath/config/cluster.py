"""Cluster shape: how many prefill (P) and decode (D) nodes, and how engines form groups."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import require


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """P prefill nodes and D decode nodes (design §2, §13.1).

    ``prefill_ep`` / ``decode_ep``: the engines of that kind form EP groups (DeepSeek
    models); otherwise each node's engines form a group (data parallel only, e.g. Qwen 32B).
    ``prefill_ep_nodes`` / ``decode_ep_nodes``: nodes per EP group; 0 (default, design §13.1)
    means one group of all nodes of that kind. Paper-scale clusters are replicas of a small
    unit: 48P96D as 24 × (EP16 prefill over 2 nodes, EP32 decode over 4 nodes) is
    ``prefill_ep_nodes=2, decode_ep_nodes=4``.
    """

    num_prefill_nodes: int = 2
    num_decode_nodes: int = 4
    prefill_ep: bool = True
    decode_ep: bool = True
    prefill_ep_nodes: int = 0
    decode_ep_nodes: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.num_prefill_nodes, int) and self.num_prefill_nodes >= 1,
            "cluster.num_prefill_nodes",
            self.num_prefill_nodes,
            "an integer >= 1",
        )
        require(
            isinstance(self.num_decode_nodes, int) and self.num_decode_nodes >= 1,
            "cluster.num_decode_nodes",
            self.num_decode_nodes,
            "an integer >= 1",
        )

        for kind, nodes, ep, per_group in (
            ("prefill", self.num_prefill_nodes, self.prefill_ep, self.prefill_ep_nodes),
            ("decode", self.num_decode_nodes, self.decode_ep, self.decode_ep_nodes),
        ):
            name = f"cluster.{kind}_ep_nodes"
            require(
                isinstance(per_group, int) and not isinstance(per_group, bool) and per_group >= 0,
                name,
                per_group,
                "an integer >= 0 (0: one EP group of all nodes)",
            )
            if per_group:
                require(ep, name, per_group, f"0 unless cluster.{kind}_ep is true")
                require(
                    nodes % per_group == 0,
                    name,
                    per_group,
                    f"a divisor of cluster.num_{kind}_nodes ({nodes})",
                )

    @property
    def prefill_group_nodes(self) -> int:
        """Nodes per PE group (1 without EP)."""
        if not self.prefill_ep:
            return 1
        return self.prefill_ep_nodes or self.num_prefill_nodes

    @property
    def decode_group_nodes(self) -> int:
        """Nodes per DE group (1 without EP)."""
        if not self.decode_ep:
            return 1
        return self.decode_ep_nodes or self.num_decode_nodes

    @property
    def label(self) -> str:
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"
