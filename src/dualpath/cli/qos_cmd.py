"""`dualpath qos`: the fabric configuration that realises the traffic manager (SPEC §6)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dualpath.cli.common import add_config_args, build_config
from dualpath.deploy.qos import QosOptions, render


def _high_limit(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: an integer in [0, 255] or 'auto'"
        ) from None


def add_qos_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "qos",
        help="OpenSM (InfiniBand) and mlnx_qos (RoCE) settings for the traffic manager (SPEC §6)",
    )
    add_config_args(p)
    p.add_argument("--fabric", default="both", choices=("ib", "roce", "both"))
    p.add_argument("--iface", default="IFACE", help="RoCE interface name in the commands")
    p.add_argument(
        "--high-limit",
        type=_high_limit,
        default=QosOptions().high_limit,
        metavar="N|auto",
        help="IB VL arbiter high limit in 4 KiB units (default: the paper's 240; "
        "'auto' derives it from sim.low_floor)",
    )
    p.add_argument("--mtu", type=int, default=4096, help="IB MTU in bytes (default 4096)")
    p.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    p.set_defaults(func=run_qos)


def run_qos(args: argparse.Namespace) -> int:
    config = build_config(args)
    if not config.sim.traffic_manager:
        raise ValueError(
            "sim.traffic_manager=false: the traffic manager is off, there are no classes to configure"
        )
    opt = QosOptions(
        high_limit=args.high_limit,
        low_share=config.sim.low_floor,
        mtu_bytes=args.mtu,
        iface=args.iface,
    )
    text = render(opt, args.fabric)
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as err:
            raise ValueError(f"--out {args.out}: cannot write ({err.strerror})") from None
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
