"""`dualpath peers`: DualPath against the KV-reuse designs the field ships (docs/peers.md),
at paper scale: the main table, a DRAM-tier size sweep and a TTL sweep, report.md, figures."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dualpath.api.peers import DEFAULT_PRESETS, PEER_SYSTEMS, TIER_BYTES, TTLS_S, compare_peers
from dualpath.cli.common import add_cache_args, cache_from_args
from dualpath.units import parse_tokens


def _floats(text: str, unit: float = 1.0) -> list[float]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(float(part) * unit)
        except ValueError:
            raise ValueError(f"{part!r} is not a number") from None
    return out


def run_peers(args: argparse.Namespace) -> int:
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    agents = [int(parse_tokens(a)) for a in args.agents.split(",") if a.strip()]
    mals = [m.strip().lower() for m in args.mal.split(",") if m.strip()]
    tiers = [] if args.no_sweeps else _floats(args.tier_gb, 1e9)
    ttls = [] if args.no_sweeps else _floats(args.ttl_s)
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers} is invalid: must be >= 1")
    t0 = time.perf_counter()
    study = compare_peers(
        presets,
        agents=agents,
        mals=mals,
        systems=systems,
        tier_bytes=tiers,
        ttls_s=ttls,
        overrides=args.overrides,
        cache=cache_from_args(args),
        workers=args.workers,
        progress=not args.no_progress,
    )
    files = study.write(Path(args.out))
    print(study.report(), end="")
    print(f"wall {time.perf_counter() - t0:.1f} s; wrote " + ", ".join(str(f) for f in files))
    return 0


def add_peers_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "peers",
        help="DualPath against the field's KV-reuse designs (docs/peers.md): table, DRAM-tier "
        "and TTL sweeps, report.md",
    )
    p.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma-separated")
    p.add_argument("--agents", default="1024", help="comma-separated agent counts (default 1024)")
    p.add_argument("--mal", default="64k", help="comma-separated MALs (default 64k)")
    p.add_argument("--systems", default=",".join(PEER_SYSTEMS), help="comma-separated systems")
    p.add_argument(
        "--tier-gb",
        default=",".join(f"{b / 1e9:g}" for b in TIER_BYTES),
        help="DRAM per node swept for dram-tier and dualpath-resident, GB (first preset)",
    )
    p.add_argument(
        "--ttl-s", default=",".join(f"{t:g}" for t in TTLS_S), help="d2p TTLs swept, seconds"
    )
    p.add_argument("--no-sweeps", action="store_true", help="the main table only")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field at every point (repeatable)",
    )
    p.add_argument("--workers", type=int, default=2, help="parallel processes (default 2)")
    add_cache_args(p)
    p.add_argument("--out", default="runs/peers", help="output folder (default runs/peers)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_peers)
