"""The vLLM connector's Layer Block copies between a node buffer and the paged KV: one
``copy_`` per block (``blocks.copy_layer``, what the connector does) against one gather and
one scatter per layer (indexed by tensors, the batched alternative), in the same run.

Run: .venv/bin/python benchmarks/bench_vllm_copy.py [--blocks 64 --layers 32 --kv-heads 8]

Shapes are vLLM CPU's paged KV (``[blocks, kv heads, block, 2 * head_dim]``, bfloat16); the
buffer is real shared memory (``SlotBuffer``). Prints GB/s of each way per direction and
their ratio; on 2 cores the figures vary by about 20% from run to run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dualpath.integrations.vllm.blocks import PagedLayout, SlotView, copy_layer
from dualpath.kv.buffer import BufferSpec, SlotBuffer
from dualpath.kv.pacer import LinkLock


def batched_copy(
    kv: torch.Tensor,
    block_ids: list[int],
    view: SlotView,
    slots: list[int],
    layer: int,
    to_buffer: bool,
) -> None:
    """The alternative: every block of the layer at once (a gather, then a scatter)."""
    rows = view.layer(layer)
    src, dst = torch.tensor(slots), torch.tensor(block_ids)
    if to_buffer:
        rows[src] = kv[dst]
    else:
        kv[dst] = rows[src]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="blocks a load moves")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    bs, n = 32, args.blocks
    names = [f"model.layers.{i}.attn" for i in range(args.layers)]
    kv = {
        name: torch.randn(2 * n, args.kv_heads, bs, 2 * args.head_dim).to(torch.bfloat16)
        for name in names
    }
    layout = PagedLayout.of(kv, bs)
    store = layout.store_layout()
    with tempfile.TemporaryDirectory() as tmp:
        spec = BufferSpec(f"dpbench{int(time.time()) % 100000}", 2 * n, store.full_block_bytes)
        buf = SlotBuffer.create(spec, LinkLock(str(Path(tmp) / "lock")))
        view = SlotView(buf.data, spec.stride_bytes, layout)
        block_ids = list(range(1, 2 * n, 2))  # scattered, as vLLM's pages are
        slots = list(range(0, 2 * n, 2))
        nbytes = n * layout.layer_block_bytes * args.layers
        print(f"{n} blocks x {args.layers} layers, {nbytes / 1e6:.1f} MB a load")
        for to_buffer, label in (
            (True, "save (paged KV -> buffer)"),
            (False, "load (buffer -> paged KV)"),
        ):
            best = {}
            for way, fn in (("loop", copy_layer), ("batched", batched_copy)):
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for i, name in enumerate(names):
                        fn(kv[name], block_ids, view, slots, i, to_buffer)
                    times.append(time.perf_counter() - t0)
                best[way] = min(times)
                print(
                    f"  {label:26s} {way:8s} {nbytes / best[way] / 1e9:6.2f} GB/s "
                    f"({best[way] * 1e3:.1f} ms)"
                )
            print(f"  {label:26s} batched/loop speed: {best['loop'] / best['batched']:.2f}x")
        del view
        buf.close()


if __name__ == "__main__":
    main()
