"""Offline calibration of the synthesiser's means to design §9's table (reproduces the
CALIBRATED and TABLE2_CALIBRATED constants of ``synth``).

Not used at run time. ``python -m dualpath.workload.calibrate [form]`` prints the
measured-vs-paper table of the 500 base trajectories (seed 0); with ``--fit`` it refits the
form's constants (minutes).
"""

from __future__ import annotations

import random
import sys

from dualpath.config.workload import SYNTH_FORMS
from dualpath.workload.stats import WorkloadStats, format_table, turns_stats
from dualpath.workload.synth import (
    REPLICA_ROUND_MAX_TOKENS,
    SPEC_TABLE,
    MalTarget,
    SynthParams,
    mal_tokens,
    synthesize_base,
    synthesize_base_table2,
)


def _measure(params: SynthParams, cap: int, n: int, seed: int) -> WorkloadStats:
    return turns_stats(synthesize_base(random.Random(seed), params, cap, n))


def calibrate(
    mal: str, num_trajectories: int = 20_000, seed: int = 12_345, iterations: int = 30
) -> SynthParams:
    """ "per_turn": fixed-point fit of (first append, planned turns, per-turn growth) to the
    table's turns, total tokens and turn-weighted context; append:gen keeps the table's ratio."""
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


def calibrate_table2(
    mal: str, num_trajectories: int = 10_000, seed: int = 12_345, iterations: int = 24
) -> SynthParams:
    """ "table2": fixed-point fit of all five constants to the table's five columns, read
    as per-trajectory means. Each constant moves the column it drives most: gen mean → gen,
    append mean → append, planned turns → turns, first append → context, and the verbosity
    spread → total (a wider spread makes short, verbose trajectories hit the MAL sooner,
    which lowers the total at equal mean turns and per-turn sizes). The last ``iterations //
    3`` iterates are averaged to damp the sampling noise of the fixed point."""
    target: MalTarget = SPEC_TABLE[mal]
    cap = mal_tokens(mal) - REPLICA_ROUND_MAX_TOKENS
    x = [
        max(1.0, 2 * target.context_tokens - target.total_tokens),
        1.5 * target.turns,
        0.7 * target.append_tokens,
        target.gen_tokens,
        0.8,
    ]
    tail: list[list[float]] = []
    for it in range(iterations):
        params = SynthParams(*x)
        rng = random.Random(seed + it)
        got = turns_stats(
            synthesize_base_table2(rng, params, cap, num_trajectories, num_trajectories)
        )
        x[0] = max(1.0, x[0] + (target.context_tokens - got.trajectory_context_tokens))
        x[1] *= target.turns / got.turns
        x[2] *= target.append_tokens / got.traj_append_tokens
        x[3] *= target.gen_tokens / got.traj_gen_tokens
        x[4] *= (got.total_tokens / target.total_tokens) ** 2
        if it >= iterations - iterations // 3:
            tail.append(list(x))
    mean = [sum(col) / len(tail) for col in zip(*tail, strict=True)]
    return SynthParams(
        round(mean[0]), round(mean[1]), round(mean[2]), round(mean[3]), round(mean[4], 3)
    )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    form = args[0] if args else "table2"
    if form not in SYNTH_FORMS:
        sys.exit(f"calibrate: unknown form {form!r}; expected one of {SYNTH_FORMS}")
    if "--fit" in sys.argv[1:]:
        fit = calibrate_table2 if form == "table2" else calibrate
        for name in SPEC_TABLE:
            print(name, fit(name), flush=True)
    else:
        print(format_table(form))
