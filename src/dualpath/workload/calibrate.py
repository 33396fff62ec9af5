"""Offline calibration of the synthesiser's means to SPEC §9's table (reproduces CALIBRATED).

Not used at run time. ``python -m dualpath.workload.calibrate`` prints the measured-vs-SPEC
table of the 500 base trajectories (seed 0); with ``--fit`` it refits CALIBRATED (minutes).
"""

from __future__ import annotations

import random
import sys

from dualpath.workload.stats import WorkloadStats, format_table, turns_stats
from dualpath.workload.synth import (
    REPLICA_ROUND_MAX_TOKENS,
    SPEC_TABLE,
    MalTarget,
    SynthParams,
    mal_tokens,
    synthesize_base,
)


def _measure(params: SynthParams, cap: int, n: int, seed: int) -> WorkloadStats:
    return turns_stats(synthesize_base(random.Random(seed), params, cap, n))


def calibrate(
    mal: str, num_trajectories: int = 20_000, seed: int = 12_345, iterations: int = 30
) -> SynthParams:
    """Fixed-point fit of (first append, planned turns, per-turn growth) to the table's
    turns, total tokens and turn-weighted context; append:gen keeps the table's ratio."""
    target: MalTarget = SPEC_TABLE[mal]
    cap = mal_tokens(mal) - REPLICA_ROUND_MAX_TOKENS
    append_share = target.append_tokens / (target.append_tokens + target.gen_tokens)
    first = max(1.0, 2 * target.context_tokens - target.total_tokens)
    planned = target.turns
    growth = (target.total_tokens - first) / target.turns
    for _ in range(iterations):
        params = SynthParams(first, planned, growth * append_share, growth * (1 - append_share))
        got = _measure(params, cap, num_trajectories, seed)
        got_growth = (got.total_tokens - first) / max(1.0, got.turns - 1)
        want_growth = (target.total_tokens - first) / max(1.0, target.turns - 1)
        growth *= want_growth / got_growth
        planned *= target.turns / got.turns
        first = max(1.0, first + (target.context_tokens - got.context_tokens))
    return SynthParams(
        round(first),
        round(planned),
        round(growth * append_share),
        round(growth * (1 - append_share)),
    )


if __name__ == "__main__":
    if "--fit" in sys.argv[1:]:
        for name in SPEC_TABLE:
            print(name, calibrate(name), flush=True)
    else:
        print(format_table())
