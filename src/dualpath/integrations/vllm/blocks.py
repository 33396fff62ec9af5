"""Layer Blocks between vLLM's paged KV and a node buffer's Full-Block slots (design §3).

vLLM hands a connector each attention layer's paged KV as a tensor whose dim 0 is the block.
One vLLM block of one layer, ``kv_layer[b]``, is one Layer Block here. A Full Block in a slot
is the model's ``num_layers`` Layer Blocks back to back, layer-major, each in the **canonical**
layout: the one a single-worker instance has, every KV head (or MLA's one latent). So a block
is the same bytes whatever the parallelism of the instance that wrote it: a worker of a
tensor-parallel instance copies its own heads' slice of each Layer Block (``RankSlice``), a
pipeline stage only its own layers (their global index: the number in the layer's name), and
the store's namespace (``setup.kv_namespace``) names the engine, the KV shape, dtype and cache
dtype, never the parallelism.

No vLLM import: plain torch over memoryviews; the tests drive it with tensors of vLLM's shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dualpath.integrations.vllm.plan import NULL_BLOCK
from dualpath.kv.store import BlockLayout


@dataclass(frozen=True, slots=True)
class RankSlice:
    """The part of a canonical Layer Block that one worker holds: KV heads ``first_head`` ..
    ``first_head + num_heads - 1`` of ``total_heads``, along dim ``heads_dim`` of its
    ``kv_layer[b]`` (None: the whole block, e.g. MLA's latent, which every rank holds whole).
    ``writer``: this worker saves its part (one replica of each part does; the others only
    load, as vLLM replicates KV heads, or MLA's latent, across tensor-parallel ranks)."""

    heads_dim: int | None = None
    first_head: int = 0
    num_heads: int = 1
    total_heads: int = 1
    writer: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.first_head <= self.total_heads - self.num_heads:
            raise ValueError(
                f"heads {self.first_head}..{self.first_head + self.num_heads - 1} are invalid: "
                f"the Layer Block has {self.total_heads}"
            )

    @classmethod
    def of_rank(
        cls,
        block_shape: Sequence[int],
        tp_rank: int,
        tp_size: int,
        total_heads: int,
        mla: bool = False,
    ) -> RankSlice:
        """Rank ``tp_rank`` of ``tp_size``'s slice of a model with ``total_heads`` KV heads,
        given its ``kv_layer[b]`` shape. vLLM gives each rank ``total // tp`` heads, or one
        head replicated over ``tp // total`` ranks when there are fewer heads than ranks."""
        if tp_size == 1:
            return cls()
        if mla:  # the latent is the same on every rank: one writes it, all load it
            return cls(writer=tp_rank == 0)
        local = max(1, total_heads // tp_size)
        replicas = max(1, tp_size // total_heads)
        dims = [i for i, d in enumerate(block_shape) if d == local]
        if not dims:
            raise ValueError(
                f"a KV block of shape {tuple(block_shape)} has no dimension of "
                f"{local} heads (rank {tp_rank} of {tp_size}, {total_heads} KV heads)"
            )
        return cls(
            dims[0], (tp_rank // replicas) * local, local, total_heads, tp_rank % replicas == 0
        )

    def canonical(self, block_shape: Sequence[int]) -> tuple[int, ...]:
        """The canonical Layer Block's shape, given this worker's ``kv_layer[b]`` shape."""
        shape = list(block_shape)
        if self.heads_dim is not None:
            shape[self.heads_dim] = self.total_heads
        return tuple(shape)

    def part(self, block: torch.Tensor) -> torch.Tensor:
        """This worker's part of a canonical Layer Block (a view)."""
        if self.heads_dim is None:
            return block
        return block.narrow(self.heads_dim, self.first_head, self.num_heads)


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """The paged KV of one vLLM worker as this module sees it: its layers in model order, each
    at its global index in the Full Block (``layer_index``), each ``kv_layer[b]`` of
    ``block_shape`` and ``dtype``, ``block_tokens`` tokens a block; ``num_layers`` layers in a
    Full Block (the model's: more than this worker's under pipeline parallelism)."""

    layer_names: tuple[str, ...]
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_tokens: int
    layer_index: tuple[int, ...] = ()  # the global index of each of ``layer_names``
    num_layers: int = 0  # a Full Block's layers; 0: this worker's
    rank: RankSlice = RankSlice()

    def __post_init__(self) -> None:
        if not self.layer_index:
            object.__setattr__(self, "layer_index", tuple(range(len(self.layer_names))))
        if not self.num_layers:
            object.__setattr__(self, "num_layers", len(self.layer_names))
        bad = [i for i in self.layer_index if not 0 <= i < self.num_layers]
        if bad or len(set(self.layer_index)) != len(self.layer_index):
            raise ValueError(
                f"layers {list(self.layer_index)} are invalid for a Full Block of "
                f"{self.num_layers} layers (each once, each below {self.num_layers})"
            )

    @classmethod
    def of(
        cls,
        kv_caches: dict[str, Any],
        block_tokens: int,
        num_layers: int = 0,
        rank: RankSlice | None = None,
    ) -> PagedLayout:
        """From the ``{layer name: paged KV tensor}`` vLLM registers (layers sorted by the
        index in their name, ``model.layers.<i>.…``, which is their place in the Full Block
        when ``num_layers`` is given: a pipeline stage registers only its own)."""
        if not kv_caches:
            raise ValueError("no KV cache layers registered")
        names = tuple(sorted(kv_caches, key=layer_index))
        first = kv_caches[names[0]]
        shape, dtype = tuple(first.shape[1:]), first.dtype
        for name in names:
            t = kv_caches[name]
            if tuple(t.shape[1:]) != shape or t.dtype != dtype:
                raise ValueError(
                    f"layer {name}: KV {tuple(t.shape)} {t.dtype} differs from "
                    f"{names[0]}'s {tuple(first.shape)} {dtype}"
                )
        index = tuple(layer_index(n)[0] for n in names) if num_layers else ()
        return cls(names, shape, dtype, block_tokens, index, num_layers, rank or RankSlice())

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        return self.rank.canonical(self.block_shape)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one canonical Layer Block (every head, whatever this worker holds)."""
        n = 1
        for d in self.canonical_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def store_layout(self) -> BlockLayout:
        """The store's Full Block for this layout (``row_bytes``: one token of one layer)."""
        if self.layer_block_bytes % self.block_tokens:
            raise ValueError(
                f"a Layer Block of {self.layer_block_bytes} bytes does not split "
                f"into {self.block_tokens} tokens"
            )
        return BlockLayout(
            self.num_layers, self.block_tokens, self.layer_block_bytes // self.block_tokens
        )


def layer_index(name: str) -> tuple[int, str]:
    """Sort key of a layer name: the first integer among its dotted parts, then the name."""
    for part in name.split("."):
        if part.isdigit():
            return int(part), name
    return -1, name


class SlotView:
    """Layer Blocks of one buffer as tensors over its memory (no copy): ``layer(l)`` is a
    ``[num_slots, *canonical_shape]`` tensor whose row ``s`` is slot ``s``'s Layer Block ``l``
    (``l`` global; rows ``stride_bytes`` apart: slots are page-aligned)."""

    def __init__(self, memory: memoryview, stride_bytes: int, layout: PagedLayout) -> None:
        self.layout = layout
        num_slots = len(memory) // stride_bytes if stride_bytes else 0
        self._rows = (
            torch.frombuffer(memory, dtype=torch.uint8).view(num_slots, stride_bytes)
            if num_slots
            else torch.empty(0, 0, dtype=torch.uint8)
        )
        self._layers: dict[int, torch.Tensor] = {}

    def layer(self, layer: int) -> torch.Tensor:
        view = self._layers.get(layer)
        if view is None:
            lay = self.layout
            nbytes = lay.layer_block_bytes
            raw = self._rows[:, layer * nbytes : (layer + 1) * nbytes]
            view = self._layers[layer] = raw.view(lay.dtype).view(-1, *lay.canonical_shape)
        return view

    def layer_block(self, slot: int, layer: int) -> torch.Tensor:
        return self.layer(layer)[slot]


def copy_layer(
    kv_layer: torch.Tensor,
    block_ids: Sequence[int],
    buffer: SlotView,
    slots: Sequence[int],
    layer: int,
    to_buffer: bool,
) -> int:
    """Global layer ``layer`` between paged blocks ``block_ids`` and slots ``slots``
    (pairwise): this worker's part of each canonical Layer Block, into the slots
    (``to_buffer``) or out of them; returns the bytes copied. vLLM's null block (a sliding
    window's skipped one) is skipped. One ``copy_`` a block: a gather and a scatter through
    one tensor copy every byte twice and measured 0.58x as fast at 8B-class shapes, 1.07x at
    the tiny model's (``benchmarks/bench_vllm_copy.py``)."""
    if len(block_ids) != len(slots):
        raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
    rows = buffer.layer(layer)
    part = buffer.layout.rank.part
    done = 0
    for b, s in zip(block_ids, slots, strict=True):
        if b == NULL_BLOCK:
            continue
        if to_buffer:
            part(rows[s]).copy_(kv_layer[b])
        else:
            kv_layer[b].copy_(part(rows[s]))
        done += 1
    nbytes = kv_layer[0].numel() * kv_layer.element_size() if len(kv_layer) else 0
    return done * nbytes


def load_layer(
    kv_layer: torch.Tensor,
    block_ids: Sequence[int],
    src: SlotView,
    slots: Sequence[int],
    layer: int,
) -> int:
    """Slots ``slots`` → paged blocks ``block_ids``, layer ``layer``; the bytes copied."""
    return copy_layer(kv_layer, block_ids, src, slots, layer, to_buffer=False)


def save_layer(
    kv_layer: torch.Tensor,
    block_ids: Sequence[int],
    dst: SlotView,
    slots: Sequence[int],
    layer: int,
) -> int:
    """Paged blocks ``block_ids`` → slots ``slots``, layer ``layer``; the bytes copied."""
    return copy_layer(kv_layer, block_ids, dst, slots, layer, to_buffer=True)
