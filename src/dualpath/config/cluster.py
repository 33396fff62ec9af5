"""Cluster shape: how many prefill (P) and decode (D) nodes, and how engines form groups."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import require


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """P prefill nodes and D decode nodes (SPEC §2, §13.1).

    ``prefill_ep`` / ``decode_ep``: all engines of that kind form one EP group (DeepSeek
    models); otherwise each node's engines form a group (data parallel only, e.g. Qwen 32B).
    """

    num_prefill_nodes: int = 2
    num_decode_nodes: int = 4
    prefill_ep: bool = True
    decode_ep: bool = True

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

    @property
    def label(self) -> str:
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"
