"""Leaf types shared by every layer: ids and enums. Imports nothing from dualpath."""

from __future__ import annotations

from enum import Enum, StrEnum


class EngineKind(StrEnum):
    """A prefill engine (PE) or a decode engine (DE)."""

    PE = "pe"
    DE = "de"


class ReadSide(StrEnum):
    """Which node's storage NIC reads a request's hit KV (SPEC §4)."""

    PE = "pe"  # classic path: storage → PE buffer
    DE = "de"  # DualPath's second path: storage → DE buffer → compute network → PE
    NONE = "none"  # nothing to read (no hits, or the Oracle)


class AttentionKind(StrEnum):
    """Attention families the cost model knows (SPEC §10)."""

    GQA = "gqa"  # dense grouped-query attention (Qwen2.5)
    MLA = "mla"  # dense multi-head latent attention (DeepSeek-V3)
    MLA_SPARSE = "mla_sparse"  # MLA + top-k sparse attention with an indexer (DeepSeek-V3.2)


class TrafficClass(int, Enum):
    """CNIC traffic classes of the traffic manager (SPEC §6). Lower value = served first."""

    HIGH = 0  # model collectives
    LOW = 1  # KV-cache traffic


EngineId = int
NodeId = int
RequestId = int
AgentId = int
