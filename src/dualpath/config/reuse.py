"""Settings of the KV-reuse designs the field ships instead of DualPath (docs/peers.md), and
of dualpath-resident: prefix caches, held decode blocks, DRAM tiers. Each default is the one
the project it models ships."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config.checks import fraction, non_negative, one_of

# which mechanism a system adds to its policy ("" for the paper's five systems)
MECHANISMS = ("", "recompute", "d2p", "d2p-evictable", "both-read", "dram-tier", "resident")
PEER_SOURCES = ("queue", "longest")


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    """``mechanism`` is set by the system being run (``config.systems``); the rest are the
    designs' parameters, each named after the knob of the project it models.

    ``d2p_ttl_s``: how long a DE holds a finished turn's blocks for the next prefill to pull
    (vLLM NixlConnector's ``decoder_kv_blocks_ttl``, 480 s; its held blocks take the DE's
    HBM until pulled or expired; ``d2p-evictable``'s yield to new turns).
    ``dram_tier_bytes``: the CPU
    tier per node (LMCache's ``max_local_cpu_size``, 5 GB per worker, × 8 workers per node;
    vLLM's OffloadingConnector has no default and takes ``cpu_bytes_to_use``).
    ``dram_tier_peer_pull``: an instance may pull blocks from another node's tier over the
    compute network (vLLM's tiering ``p2p`` tier, llm-d's router); the source is the holder
    with the shortest storage read queue (``peer_source="queue"``) or the one holding the
    longest prefix (``"longest"``). ``resident_bytes``: decode-node DRAM dualpath-resident
    keeps finished turns' KV in, per node (default: as much DRAM as ``dram_tier_bytes``, so
    the two compare like for like). ``prefix_cache_share``: share of a PE's HBM KV space its
    prefix cache may hold (vLLM's prefix cache uses every free block: 1.0).
    """

    mechanism: str = ""
    d2p_ttl_s: float = 480.0
    dram_tier_bytes: float = 40e9
    dram_tier_peer_pull: bool = False
    peer_source: str = "queue"
    resident_bytes: float = 40e9
    prefix_cache_share: float = 1.0

    def __post_init__(self) -> None:
        one_of("reuse.mechanism", self.mechanism, MECHANISMS)
        one_of("reuse.peer_source", self.peer_source, PEER_SOURCES)
        non_negative("reuse.d2p_ttl_s", self.d2p_ttl_s)
        non_negative("reuse.dram_tier_bytes", self.dram_tier_bytes)
        non_negative("reuse.resident_bytes", self.resident_bytes)
        fraction("reuse.prefix_cache_share", self.prefix_cache_share)
