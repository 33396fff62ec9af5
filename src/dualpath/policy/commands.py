"""Decisions of the policy core, as frozen commands the shells carry out."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.types import ReadSide


@dataclass(frozen=True, slots=True)
class Assign:
    """Serve ``request_id`` on PE ``pe`` and DE ``de``; read its hit KV on ``read_side``.

    With split reads (beyond the paper) ``pe_read_tokens`` + ``de_read_tokens`` = hit tokens
    and both may be non-zero; otherwise one of them is zero. Both are multiples of the block
    size except possibly for a final partial block.
    """

    request_id: int
    pe: int
    de: int
    read_side: ReadSide
    pe_read_tokens: int
    de_read_tokens: int


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
