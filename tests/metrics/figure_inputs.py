"""Small synthetic inputs for the figure functions and `dualpath figures`, shared by their tests."""

from __future__ import annotations

OFFLINE = [
    {"model": m, "mal": mal, "agents": n, "system": s, "jct_s": 100.0 * k}
    for m in ("DS 27B", "DS 660B")
    for mal in ("32K", "64K")
    for n in (512, 1024)
    for s, k in (("Basic", 1.8), ("DualPath", 1.0), ("Oracle", 0.9))
]
PD = [
    {"pd": pd, "system": s, "jct_s": v}
    for pd, b, d in (("1P1D", 10.0, 6.0), ("1P2D", 10.0, 4.0), ("2P1D", 6.0, 4.0))
    for s, v in (("Basic", b), ("DualPath", d))
]
LATENCY = [
    {"system": s, "aps": a, "ttft_s": t, "ttst_s": 0.2, "tpot_s": None if a > 0.3 else 0.03}
    for s, k in (("Basic", 2.0), ("DualPath", 1.0))
    for a, t in ((0.1, 1.0 * k), (0.2, 2.0 * k), (0.4, 30.0 * k))
]
BREAKDOWN = [
    {"system": s, "aps": a, "queue_s": q * a, "alloc_s": 0.1, "read_s": 0.8, "prefill_s": 0.5}
    for s, q in (("Basic", 10.0), ("DualPath", 0.5))
    for a in (0.1, 0.2)
]
ABLATION = [
    {"system": s, "jct_s": v}
    for s, v in (("Basic", 10.0), ("+Layer", 9.0), ("+DPL", 6.5), ("+Sched", 5.5))
]
SERIES = {"DualPath": [(0.0, 1.05), (5.0, 1.1)], "Round robin": [(0.0, 1.6), (5.0, 1.4)]}
