"""`dualpath cluster up/status/down/ray/exec`: a cluster of nodes on one host (deploy/)."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

from dualpath.deploy import cluster, ray_cluster
from dualpath.deploy.cluster import ClusterSpec, ClusterState


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster", help="a cluster of nodes on one host: network namespaces, bridges, shaped NICs"
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    up = verbs.add_parser("up", help="make the namespaces, bridges and shaped NICs")
    _add_name(up)
    up.add_argument("--preset", default="tiny-1p1d", help="cluster preset (default tiny-1p1d)")
    up.add_argument(
        "--snic-mbit",
        type=float,
        default=16.0,
        help="each node's SNIC, Mbit/s; sets the scale of every rate (default 16)",
    )
    up.add_argument(
        "--cnic-cap-mbit",
        type=float,
        default=2000.0,
        help="cap on each node's CNIC, Mbit/s (default 2000)",
    )
    up.add_argument(
        "--store-mbit",
        type=float,
        default=0.0,
        help="the storage host's SNIC, Mbit/s (default 0: unshaped)",
    )
    up.add_argument("--subnet", default=None, help="a private /16, e.g. 10.150 (default: by name)")
    up.add_argument("--replace", action="store_true", help="take down a cluster of that name first")
    up.add_argument(
        "--traffic-manager",
        action="store_true",
        help="CNICs with the traffic manager's two tc classes instead of one queue "
        "(`dualpath qos --apply/--remove --cluster NAME` switches later)",
    )
    up.set_defaults(func=run_up)

    st = verbs.add_parser("status", help="nodes, addresses, rates and byte counters")
    _add_name(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(func=run_status)

    dn = verbs.add_parser("down", help="remove the cluster and whatever a crashed run left")
    _add_name(dn)
    dn.set_defaults(func=run_down)

    ry = verbs.add_parser("ray", help="start (or --stop) a Ray cluster over the nodes' CNICs")
    _add_name(ry)
    ry.add_argument(
        "--port",
        type=int,
        default=ray_cluster.DEFAULT_PORT,
        help="the head's GCS port (default 6379)",
    )
    ry.add_argument("--stop", action="store_true", help="stop the Ray cluster started here")
    ry.set_defaults(func=run_ray)

    ex = verbs.add_parser("exec", help="run a command in a node's namespace: exec NODE -- CMD...")
    ex.add_argument("node", help="p0.., d0.. or store")
    _add_name(ex)
    # REMAINDER: argparse drops a `--` that follows a sub-subcommand's options; run_exec splits
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command")
    ex.set_defaults(func=run_exec)


def _add_name(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="dp", help="cluster name, [a-z0-9]{1,6} (default dp)")


def _mbit(bytes_per_s: float) -> str:
    return "unshaped" if bytes_per_s <= 0 else f"{bytes_per_s * 8 / 1e6:g} Mbit/s"


def _table(info: dict[str, Any], counters: bool) -> str:
    head = ["node", "kind", "namespace", "CNIC addr", "CNIC rate", "SNIC addr", "SNIC rate"]
    if counters:
        head += ["CNIC rx/tx B", "SNIC rx/tx B"]
    rows = [head]
    for n in info["nodes"]:
        cnic, snic = n.get("cnic"), n["snic"]
        row = [
            n["node"],
            n["kind"],
            n["namespace"] + ("" if n.get("up", True) else " (gone)"),
            cnic["addr"] if cnic else "-",
            _mbit(cnic["rate_bytes_per_s"]) if cnic else "-",
            snic["addr"],
            _mbit(snic["rate_bytes_per_s"]),
        ]
        if counters:
            row += [
                f"{cnic['rx_bytes']}/{cnic['tx_bytes']}" if cnic else "-",
                f"{snic['rx_bytes']}/{snic['tx_bytes']}",
            ]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    head_seat = (
        f"head (root namespace): {info['head']['cnic']} compute, {info['head']['snic']} storage"
    )
    tm = "two classes (dualpath qos)" if info.get("traffic_manager") else "one queue (tbf)"
    return "\n".join([*lines, head_seat, f"CNIC queues: {tm}"])


def _describe(state: ClusterState) -> dict[str, Any]:
    spec = state.spec
    nodes = []
    for node in spec.nodes:
        entry: dict[str, Any] = {"node": node.name, "kind": node.kind, "namespace": node.namespace}
        for nic in ("cnic", "snic"):
            addr = getattr(node, f"{nic}_addr")
            if addr:
                entry[nic] = {
                    "addr": addr,
                    "rate_bytes_per_s": spec.rate_bytes_per_s(node.name, nic),
                }
        nodes.append(entry)
    head = {"cnic": spec.head_cnic_addr, "snic": spec.head_snic_addr}
    return {"nodes": nodes, "head": head, "traffic_manager": spec.traffic_manager}


def run_up(args: argparse.Namespace) -> int:
    spec = ClusterSpec.from_preset(
        preset=args.preset,
        name=args.name,
        snic_mbit=args.snic_mbit,
        cnic_cap_mbit=args.cnic_cap_mbit,
        store_mbit=args.store_mbit,
        subnet=args.subnet,
        traffic_manager=args.traffic_manager,
    )
    state = cluster.up(spec, replace=args.replace)
    print(
        f"cluster {spec.name!r} up: preset {spec.preset}, subnet {spec.subnet}, "
        f"rates × {spec.rates.scale:g} of the preset's"
    )
    print(_table(_describe(state), counters=False))
    print(f"run in a node: dualpath cluster exec NODE --name {spec.name} -- CMD...")
    print(f"tear down:     dualpath cluster down --name {spec.name}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    cluster.check_name(args.name)
    info = cluster.status(args.name)
    print(json.dumps(info, indent=2) if args.json else _table(info, counters=True))
    return 0


def run_down(args: argparse.Namespace) -> int:
    # Ray's head runs in the root namespace: stopped first (its raylets would die with the
    # namespaces, the head would not)
    removed = [f"ray {item}" for item in ray_cluster.stop_ray(args.name)]
    removed += cluster.down(args.name)
    for item in removed:
        print(f"removed {item}")
    print(f"cluster {args.name!r} down" + ("" if removed else " (nothing was left)"))
    return 0


def run_ray(args: argparse.Namespace) -> int:
    if args.stop:
        stopped = ray_cluster.stop_ray(args.name)
        print(f"Ray on cluster {args.name!r} stopped" + ("" if stopped else " (none was started)"))
        return 0
    reason = cluster.can_make_namespaces()
    if reason is not None:
        raise cluster.ClusterError(reason)
    rc = ray_cluster.start_ray(ClusterState.load(args.name), port=args.port)
    print(f"Ray on cluster {args.name!r}: {rc.address} (head + {len(rc.pgids) - 1} raylets)")
    print(f"run:  {ray_cluster.bench_command(rc)}")
    print(f"stop: dualpath cluster ray --name {args.name} --stop")
    return 0


def run_exec(args: argparse.Namespace) -> int:
    rest: list[str] = args.argv
    if "--" in rest:  # options between NODE and `--` (e.g. --name) land in the remainder
        cut = rest.index("--")
        opts, argv = rest[:cut], rest[cut + 1 :]
        opt = argparse.ArgumentParser(
            prog="dualpath cluster exec", add_help=False, exit_on_error=False
        )
        _add_name(opt)
        try:
            known, extra = opt.parse_known_args(opts)
        except argparse.ArgumentError as err:
            raise ValueError(f"exec: {err}") from None
        if extra:
            raise ValueError(f"exec: unrecognized arguments before --: {' '.join(extra)}")
        args.name = known.name if opts else args.name
    else:
        argv = rest
    if not argv:
        raise ValueError("exec needs a command: dualpath cluster exec NODE -- CMD...")
    reason = cluster.can_make_namespaces()
    if reason is not None:
        raise cluster.ClusterError(reason)
    state = ClusterState.load(args.name)
    state.spec.node(args.node)  # names the node if it is unknown
    return subprocess.run(cluster.node_argv(state, args.node, argv)).returncode
