"""Leaf types shared by every layer: ids and enums. Imports nothing from dualpath."""

from __future__ import annotations

from enum import Enum, StrEnum


class EngineKind(StrEnum):
    """A prefill engine (PE) or a decode engine (DE)."""

    PE = "pe"
    DE = "de"


class ReadSide(StrEnum):
    """Which node's storage NIC reads a request's hit KV (design §4)."""

    PE = "pe"  # classic path: storage → PE buffer
    DE = "de"  # DualPath's second path: storage → DE buffer → compute network → PE
    NONE = "none"  # nothing to read (no hits, or the Oracle)


class KVPath(StrEnum):
    """The hops KV bytes take (design §4), one name each for every shell, result and metric:
    ``RunResult.bytes_by_path``, the server's ``dualpath:kv_bytes_total{path=...}``, the
    simulator's bytes per path. A layer load is counted per source buffer where the shell
    knows it (the simulator), else as ``BUFFER_TO_PE_HBM`` (the runtime)."""

    STORAGE_TO_PE_BUFFER = "storage_to_pe_buffer"  # PE read path: the PE node's SNIC reads
    STORAGE_TO_DE_BUFFER = "storage_to_de_buffer"  # DE read path: the DE node's SNIC reads
    PE_BUFFER_TO_PE_HBM = "pe_buffer_to_pe_hbm"  # Layer Blocks, PE read path
    DE_BUFFER_TO_PE_HBM = "de_buffer_to_pe_hbm"  # Layer Blocks over the compute network
    BUFFER_TO_PE_HBM = "buffer_to_pe_hbm"  # the two above together
    PE_HBM_TO_DE_BUFFER = "pe_hbm_to_de_buffer"  # prefill's KV to the DE (the PD transfer)
    DE_BUFFER_TO_DE_HBM = "de_buffer_to_de_hbm"  # H2D before decode
    DE_TO_STORAGE = "de_to_storage"  # Full Blocks persisted by the DE
    # Full Blocks of a prompt persisted by its PE node (the vLLM shell across nodes, where the
    # policy spreads writes over both nodes' SNICs: ``policy.side.SideRule.write_node``)
    PE_TO_STORAGE = "pe_to_storage"
    # hits that skip storage (the field's designs and dualpath-resident, docs/peers.md): from a
    # DRAM tier on the PE's own node, and from another node (its DRAM tier, a DE's HBM, a
    # decode node's DRAM) over the compute network
    PE_DRAM_TO_PE_HBM = "pe_dram_to_pe_hbm"
    PEER_TO_PE_HBM = "peer_to_pe_hbm"


class ReuseSource(StrEnum):
    """Where a turn's hit KV is found without reading storage (docs/peers.md)."""

    NONE = "none"  # nowhere: the hit is read from storage (or, recompute, computed again)
    PE_HBM = "pe_hbm"  # the PE's own HBM prefix cache: no transfer
    PE_DRAM = "pe_dram"  # a DRAM tier on the PE's node: DRAM → PE HBM
    PEER_DRAM = "peer_dram"  # another node's DRAM tier: over the compute network
    DE_HBM = "de_hbm"  # the DE's HBM (blocks held after the previous turn): over the network
    PEER_HBM = "peer_hbm"  # another DE's HBM (held there; the turn decodes elsewhere)
    DE_DRAM = "de_dram"  # the DE node's DRAM (KV kept after the previous turn): over the network


class AttentionKind(StrEnum):
    """Attention families the cost model knows (design §10)."""

    GQA = "gqa"  # dense grouped-query attention (Qwen2.5)
    MLA = "mla"  # dense multi-head latent attention (DeepSeek-V3)
    MLA_SPARSE = "mla_sparse"  # MLA + top-k sparse attention with an indexer (DeepSeek-V3.2)


class TrafficClass(int, Enum):
    """CNIC traffic classes of the traffic manager (design §6). Lower value = served first."""

    HIGH = 0  # model collectives
    LOW = 1  # KV-cache traffic


EngineId = int
NodeId = int
RequestId = int
AgentId = int
