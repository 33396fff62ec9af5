"""Decisions of the policy core, as frozen commands the shells carry out."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.types import ReadSide, ReuseSource


@dataclass(frozen=True, slots=True)
class Assign:
    """Serve ``request_id`` on PE ``pe`` and DE ``de``; read its hit KV on ``read_side``.

    With split reads (beyond the paper) ``pe_read_tokens`` + ``de_read_tokens`` = hit tokens
    and both may be non-zero; otherwise one of them is zero. Both are multiples of the block
    size except possibly for a final partial block.

    The reuse designs (``policy.reuse``, docs/peers.md) find part of the hit elsewhere:
    ``reuse_tokens`` (a prefix of the hit) from ``reuse_source`` on node ``reuse_node``
    (no storage read; held in the HBM of engine ``reuse_engine``, -1 for DRAM); ``recompute_tokens`` of the hit are computed again (no storage tier);
    ``de_prefetch_tokens``: the DE node also reads that many hit tokens through its own
    storage NIC, so the PE sends it only the new KV (both-read). Then
    ``pe_read_tokens + de_read_tokens + reuse_tokens + recompute_tokens`` = hit tokens.
    """

    request_id: int
    pe: int
    de: int
    read_side: ReadSide
    pe_read_tokens: int
    de_read_tokens: int
    reuse_source: ReuseSource = ReuseSource.NONE
    reuse_node: int = -1
    reuse_engine: int = -1
    reuse_tokens: int = 0
    recompute_tokens: int = 0
    de_prefetch_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part of a request computed in one PE forward pass: ``cached`` tokens have KV
    (storage hits or earlier chunks), ``new`` tokens are computed now."""

    request_id: int
    cached: int
    new: int
    is_last: bool


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One PE forward pass: the chunks it computes and its predicted attention time."""

    engine_id: int
    chunks: tuple[Chunk, ...]
    predicted_attention_s: float
