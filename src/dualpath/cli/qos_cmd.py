"""`dualpath qos`: the fabric configuration that realises the traffic manager (design §6).

Prints OpenSM (InfiniBand) and ``mlnx_qos`` (RoCE) settings; on a Linux host ``--apply``
sets the same arbiter with ``tc`` on one interface (``--iface``) or on every CNIC of a
one-host cluster (``--cluster``), ``--remove`` takes it off, ``--dry-run`` prints the ``tc``
commands instead of running them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from dualpath.cli.common import add_config_args, build_config
from dualpath.deploy import cluster
from dualpath.deploy.qos import (
    QosOptions,
    render,
    run_commands,
    tc_commands,
    tc_remove_commands,
    tc_script,
)


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
        help="OpenSM (InfiniBand) and mlnx_qos (RoCE) settings for the traffic manager (arXiv 2602.21548 §5)",
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
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--apply",
        action="store_true",
        help="set the two classes with Linux tc (on --iface or --cluster's CNICs)",
    )
    act.add_argument("--remove", action="store_true", help="take the tc classes off again")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --apply/--remove: print the tc commands, run nothing",
    )
    p.add_argument("--netns", default=None, help="--iface lives in this network namespace")
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="--iface's link rate, Mbit/s (default: its reported speed)",
    )
    p.add_argument(
        "--cluster",
        metavar="NAME",
        default=None,
        help="every CNIC of this `dualpath cluster` (its rates; --remove: one queue)",
    )
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
    if args.apply or args.remove:
        return _tc(args, opt)
    if args.dry_run or args.cluster or args.netns or args.rate_mbit is not None:
        raise ValueError(
            "--dry-run, --cluster, --netns and --rate-mbit go with --apply or --remove"
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


def _link_mbit(iface: str, netns: str | None) -> float:
    """``iface``'s reported speed (Mbit/s) from sysfs; a clear error when it has none."""
    argv = ["cat", f"/sys/class/net/{iface}/speed"]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(argv, capture_output=True, text=True)
    text = done.stdout.strip()
    if done.returncode != 0 or not text.lstrip("-").isdigit() or int(text) <= 0:
        raise ValueError(f"--iface {iface}: its link speed is unknown; give --rate-mbit")
    return float(text)


def _tc(args: argparse.Namespace, opt: QosOptions) -> int:
    if args.cluster:
        if args.iface != "IFACE" or args.netns or args.rate_mbit is not None:
            raise ValueError(
                "--cluster takes its interfaces and rates from the cluster: "
                "drop --iface, --netns and --rate-mbit"
            )
        if args.dry_run:
            spec = cluster.ClusterState.load(args.cluster).spec
            cmds = [a for n in spec.nodes for a in cluster.cnic_shaping(spec, n, args.apply)]
            sys.stdout.write(tc_script(cmds, f"# cluster {args.cluster}: every CNIC, both ends"))
            return 0
        state = cluster.set_traffic_manager(args.cluster, args.apply)
        what = "two classes" if args.apply else "one queue (tbf)"
        print(f"cluster {args.cluster}: every CNIC now has {what}", file=sys.stderr)
        del state
        return 0
    if args.iface == "IFACE":
        raise ValueError("--apply/--remove need --iface IF (or --cluster NAME)")
    if args.remove:
        cmds = tc_remove_commands(args.iface, args.netns)
    else:
        mbit = args.rate_mbit if args.rate_mbit is not None else _link_mbit(args.iface, args.netns)
        cmds = tc_commands(opt, args.iface, mbit * 1e6 / 8, args.netns)
    if args.dry_run:
        sys.stdout.write(tc_script(cmds, f"# dualpath traffic manager on {args.iface} (tc)"))
        return 0
    run_commands(cmds)
    print(
        f"{args.iface}: {'two classes set' if args.apply else 'classes removed'}", file=sys.stderr
    )
    return 0
