"""Closed forms of layer pipelining (design §8), used to aggregate a forward pass's layers.

Pure functions; ``tests/sim/test_passes.py`` checks them against an explicit per-layer run.
"""

from __future__ import annotations


def flow_shop_s(num_layers: int, *stage_totals_s: float) -> float:
    """Makespan of ``num_layers`` identical layers through stages in series (load → compute →
    send), each stage taking ``total / num_layers`` per layer, unbounded buffers between stages:
    ``Σ per-layer times + (L − 1) · max per-layer time``. Two stages with per-layer compute c and
    transfer t give ``L·max(c, t) + min(c, t)``."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} is invalid: must be >= 1")
    per_layer = [t / num_layers for t in stage_totals_s]
    if not per_layer:
        return 0.0
    return sum(per_layer) + (num_layers - 1) * max(per_layer)


def layerwise_pass_s(num_layers: int, load_s: float, compute_s: float, send_s: float) -> float:
    """Layerwise prefill (design §8): load, compute and send of the layers all overlap."""
    return flow_shop_s(num_layers, load_s, compute_s, send_s)


def serial_pass_s(num_layers: int, load_s: float, compute_s: float, send_s: float) -> float:
    """Without layerwise prefill (the classic path, design §8/§11): the whole batch's KV is
    loaded into HBM before the forward pass, and sent to the DE after it: no overlap."""
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} is invalid: must be >= 1")
    return load_s + compute_s + send_s
