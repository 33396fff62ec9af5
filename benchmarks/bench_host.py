"""Host speed figures that unit tests must not assert: how closely a pacer's transfers follow
their reserved link time on this host's wall clock, the copy bandwidth the profiler uses, and
whether the calibration fits this host's measured tiny-model timings.

Run: .venv/bin/python benchmarks/bench_host.py [--rate-mb-per-s 10 --transfers 20]
Prints, per transfer size, wall time / reserved link time (1.00 = exact pacing; above 1: the
host's sleep granularity and scheduling), and the memory copy bandwidth in GB/s.
"""

from __future__ import annotations

import argparse
import time

from dualpath.config import preset
from dualpath.kv.pacer import Pacer
from dualpath.models.calibrate import fit
from dualpath.runtime.profile import memory_bytes_per_s, profile_host
from dualpath.types import TrafficClass


def pacing_ratio(rate_bytes_per_s: float, nbytes: int, transfers: int) -> float:
    """Wall time of ``transfers`` back-to-back paced transfers over their reserved link time."""
    pacer = Pacer(rate_bytes_per_s, "bench")
    start = time.monotonic()
    for _ in range(transfers):
        pacer.transfer(nbytes, TrafficClass.LOW)
    wall = time.monotonic() - start
    return wall / pacer.stats.busy_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-mb-per-s", type=float, default=10.0)
    ap.add_argument("--transfers", type=int, default=20)
    args = ap.parse_args()
    if args.rate_mb_per_s <= 0 or args.transfers < 1:
        raise SystemExit("--rate-mb-per-s must be > 0 and --transfers >= 1")
    rate = args.rate_mb_per_s * 1e6
    for nbytes in (10_000, 100_000, 1_000_000):
        ratio = pacing_ratio(rate, nbytes, args.transfers)
        print(
            f"pacer {nbytes:>9} B x {args.transfers} at {args.rate_mb_per_s:g} MB/s: "
            f"wall / link time {ratio:.3f}"
        )
    print(f"memory copy bandwidth {memory_bytes_per_s() / 1e9:.2f} GB/s (read + written)")
    cfg = preset("tiny-1p1d")
    prof = profile_host(cfg.model, cfg.scheduler.block_tokens)
    try:
        f = fit(cfg.model, prof.prefill, prof.decode, prof.memory_bytes_per_s)
    except ValueError as err:
        print(f"calibration on this host's tiny-model timings: refused ({err})")
        return
    print(
        f"calibration on this host's tiny-model timings: prefill within "
        f"{f.prefill_max_rel_err:.0%}, decode within {f.decode_max_rel_err:.0%}"
    )


if __name__ == "__main__":
    main()
