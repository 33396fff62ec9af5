"""`dualpath plan`: the bottleneck-free P/D report (design §5)."""

from __future__ import annotations

import argparse
import json
import sys

from dualpath.cli.common import add_config_args, build_config
from dualpath.models.planner import PlanReport, as_fraction, plan


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="bottleneck-free P/D range and resource loads (docs/design.md §5)"
    )
    add_config_args(p)
    p.add_argument("--P", dest="p", type=int, help="prefill nodes (default: the preset's)")
    p.add_argument("--D", dest="d", type=int, help="decode nodes (default: the preset's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plan)


def report_dict(r: PlanReport) -> dict[str, object]:
    return {
        "P": r.num_prefill_nodes,
        "D": r.num_decode_nodes,
        "ratio": r.ratio,
        "range": {
            "lower": r.lower,
            "upper": r.upper,
            "lower_binding": r.lower_binding,
            "upper_binding": r.upper_binding,
        },
        "bounds": [{"resource": b.resource, "kind": b.kind, "value": b.value} for b in r.bounds],
        "in_range": r.in_range,
        "de_path_share": r.de_path_share,
        "ideal_io_speedup": r.ideal_io_speedup,
        "loads": [
            {
                "resource": x.resource,
                "load_bytes_per_s": x.load_bytes_per_s,
                "capacity_bytes_per_s": x.capacity_bytes_per_s,
                "fraction": x.fraction,
            }
            for x in r.loads
        ],
    }


def format_report(r: PlanReport, name: str) -> str:
    lines = [
        f"DualPath planner — {name}: P={r.num_prefill_nodes}, D={r.num_decode_nodes} "
        f"(P/D = {as_fraction(r.ratio)})",
        "",
        f"Bottleneck-free range:  {as_fraction(r.lower)} ≤ P/D ≤ {as_fraction(r.upper)}",
        f"  lower bound set by {r.lower_binding}; upper bound set by {r.upper_binding}",
        "",
        "  bound                 kind    P/D",
    ]
    for b in r.bounds:
        lines.append(f"  {b.resource:<20}  {b.kind:<6}  {as_fraction(b.value)}")
    lines += [
        "",
        "Resource loads with every storage NIC saturated:",
        "  resource          load GB/s   capacity GB/s   load",
    ]
    for x in r.loads:
        mark = "  ← over capacity" if x.fraction > 1 + 1e-9 else ""
        lines.append(
            f"  {x.resource:<16}  {x.load_bytes_per_s / 1e9:9.1f}   {x.capacity_bytes_per_s / 1e9:13.1f}"
            f"   {100 * x.fraction:5.1f}%{mark}"
        )
    lines += [
        "",
        f"Hit bytes on the DE read path: D/(P+D) = {100 * r.de_path_share:.1f}%",
        f"Ideal I/O speedup over the classic path: (P+D)/P = {r.ideal_io_speedup:.2f}×",
    ]
    if not r.in_range:
        lines += [
            "",
            f"WARNING: P/D = {as_fraction(r.ratio)} is outside the bottleneck-free range; "
            f"{r.bottleneck.resource} limits storage reads "
            f"({100 * r.bottleneck.fraction:.0f}% of capacity needed).",
        ]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    config = build_config(args)
    report = plan(config, args.p, args.d)
    if args.json:
        json.dump(report_dict(report), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, config.name))
    if not report.in_range:
        print(
            f"warning: P/D={as_fraction(report.ratio)} outside bottleneck-free range "
            f"[{as_fraction(report.lower)}, {as_fraction(report.upper)}]",
            file=sys.stderr,
        )
    return 0
