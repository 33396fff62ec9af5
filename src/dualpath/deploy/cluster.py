"""A cluster of nodes on one host: one network namespace per node, two bridged networks, NICs
shaped by the kernel (``tc tbf``). Owns ``up`` / ``down`` / ``status`` and the state file; it
never starts engines (callers run them with ``popen``).

Layout of cluster NAME (``[a-z0-9]{1,6}``, default ``dp``) from a cluster preset with P prefill
and D decode nodes:

- nodes ``p0..p{P-1}`` (kind prefill), ``d0..d{D-1}`` (decode) and ``store`` (the storage
  host); node X lives in network namespace ``dp-NAME-X``, with ``lo`` up;
- two Linux bridges in the root namespace: compute ``dpNAMEc`` and storage ``dpNAMEs``;
- each node has a CNIC ``cnic`` (veth, peer ``dpNAME-Xc`` on the compute bridge) and an SNIC
  ``snic`` (veth, peer ``dpNAME-Xs`` on the storage bridge); the storage host only ``snic``;
- addresses in ``10.N.0.0/16`` with ``N = 100 + crc32(NAME) % 100`` (``--subnet`` overrides):
  compute ``10.N.1.0/24``, storage ``10.N.2.0/24``; the root namespace (the head seat: router,
  clients) holds ``.1`` on both bridges, prefill node i ``.10+i``, decode node i ``.20+i`` on
  both networks, the storage host ``.254`` on the storage network. No default routes, no
  forwarding: traffic stays on the two /24s.
- rates: the preset's SNIC per node (``snic_total_bytes_per_s``) and CNIC per node
  (``gpus_per_node * cnic_bytes_per_s``) times one factor that brings the SNIC to
  ``snic_mbit``; the CNIC is capped at ``cnic_cap_mbit``. The storage host's SNIC is unshaped
  unless ``store_mbit > 0``. Each shaped NIC is shaped on both of its veth ends' egress
  (node side: node → network, bridge side: network → node): a CNIC by a ``tbf``
  (``tbf_args``), an SNIC by an HTB that sends small packets (TCP acknowledgements, the
  store's RPCs) ahead of bulk data at the same total rate (``qos.tc_small_first_commands``:
  one FIFO would hold a read's acknowledgements behind 50 ms of writes). With the
  traffic manager on (``up --traffic-manager`` or ``dualpath qos --cluster NAME --apply``)
  each CNIC end gets the two classes of ``deploy.qos.tc_commands`` at the same rate instead
  (collectives' DSCP high, everything else low; docs/operations.md).
- state: ``$DUALPATH_RUN_DIR/NAME.json`` (default ``/run/dualpath``); processes started in the
  cluster name their shared-memory segments ``/dev/shm/dpNAME-*`` so that ``down`` finds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dualpath.config.presets import preset as cluster_preset
from dualpath.deploy.qos import QosOptions, tc_commands, tc_small_first_commands

Nic = Literal["cnic", "snic"]
NodeKind = Literal["prefill", "decode", "store"]

NAME_PATTERN = re.compile(r"[a-z0-9]{1,6}")
RUN_DIR_ENV = "DUALPATH_RUN_DIR"
DEFAULT_RUN_DIR = "/run/dualpath"
SHM_DIR = Path("/dev/shm")
MAX_PREFILL_NODES = 10  # addresses .10-.19
MAX_DECODE_NODES = 200  # addresses .20-.219
TBF_LATENCY_MS = 50  # queue bound: how long a packet may wait in the shaper before a drop
TBF_MIN_BURST_BYTES = 32 * 1024  # a few full-size GSO packets
TBF_BURST_S = 0.004  # bucket depth: 4 ms at the rate (≥ a jiffy at HZ=250)
KILL_WAIT_S = 5.0


class ClusterError(ValueError):
    """A cluster that cannot be made, found or used: one line for the user."""


@dataclass(frozen=True, slots=True)
class Node:
    """One node: its name (``p0``, ``d0``, ``store``), kind and namespace; addresses without
    the prefix length (``cnic_addr`` is ``""`` for the storage host, which has no CNIC)."""

    name: str
    kind: NodeKind
    namespace: str
    cnic_addr: str
    snic_addr: str


@dataclass(frozen=True, slots=True)
class NicRates:
    """Rates on this host, bytes/s; 0 means unshaped. ``scale`` = host / preset rate."""

    scale: float
    snic_bytes_per_s: float
    cnic_bytes_per_s: float
    store_bytes_per_s: float
    preset_snic_bytes_per_s: float
    preset_cnic_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What ``up`` makes; build it with ``from_preset``. ``subnet`` is the cluster's /16."""

    name: str
    preset: str
    nodes: tuple[Node, ...]
    subnet: str
    rates: NicRates
    traffic_manager: bool = False  # CNICs: two tc classes (True) or one queue (tbf)

    def __post_init__(self) -> None:
        check_name(self.name)

    @classmethod
    def from_preset(
        cls,
        preset: str = "tiny-1p1d",
        name: str = "dp",
        snic_mbit: float = 16.0,
        cnic_cap_mbit: float = 2000.0,
        store_mbit: float = 0.0,
        subnet: str | None = None,
        traffic_manager: bool = False,
    ) -> ClusterSpec:
        check_name(name)
        for field, value in (("snic_mbit", snic_mbit), ("cnic_cap_mbit", cnic_cap_mbit)):
            if not value > 0:
                raise ValueError(f"{field}={value!r} is invalid: must be > 0")
        if not store_mbit >= 0:
            raise ValueError(f"store_mbit={store_mbit!r} is invalid: must be >= 0 (0 = unshaped)")
        config = cluster_preset(preset)
        num_p, num_d = config.cluster.num_prefill_nodes, config.cluster.num_decode_nodes
        if num_p > MAX_PREFILL_NODES or num_d > MAX_DECODE_NODES:
            raise ValueError(
                f"preset={preset!r} has {num_p} prefill and {num_d} decode nodes: a cluster on "
                f"one host holds at most {MAX_PREFILL_NODES} and {MAX_DECODE_NODES}"
            )
        net = parse_subnet(subnet) if subnet else default_subnet(name)
        hw = config.hardware
        snic, cnic = hw.snic_total_bytes_per_s, hw.gpus_per_node * hw.cnic_bytes_per_s
        scale = snic_mbit * 1e6 / 8 / snic
        rates = NicRates(
            scale=scale,
            snic_bytes_per_s=snic * scale,
            cnic_bytes_per_s=min(cnic * scale, cnic_cap_mbit * 1e6 / 8),
            store_bytes_per_s=store_mbit * 1e6 / 8,
            preset_snic_bytes_per_s=snic,
            preset_cnic_bytes_per_s=cnic,
        )
        nodes = layout(name, net, num_p, num_d)
        return cls(name, preset, nodes, str(net), rates, traffic_manager)

    def node(self, node: str) -> Node:
        for n in self.nodes:
            if n.name == node:
                return n
        known = ", ".join(n.name for n in self.nodes)
        raise ValueError(f"node={node!r} is invalid: cluster {self.name!r} has {known}")

    def address(self, node: str, nic: Nic) -> str:
        """``node``'s address on ``nic`` (no prefix length); ValueError for the store's CNIC."""
        n = self.node(node)
        addr = n.cnic_addr if nic == "cnic" else n.snic_addr if nic == "snic" else None
        if not addr:
            raise ValueError(f"nic={nic!r} is invalid for node {node!r}: it has {nics(n)}")
        return addr

    def rate_bytes_per_s(self, node: str, nic: Nic) -> float:
        """The shaped rate of ``node``'s ``nic`` in bytes/s; 0 = unshaped."""
        self.address(node, nic)
        if self.node(node).kind == "store":
            return self.rates.store_bytes_per_s
        return self.rates.cnic_bytes_per_s if nic == "cnic" else self.rates.snic_bytes_per_s

    @property
    def head_cnic_addr(self) -> str:
        return _host(self.subnet, 1, 1)

    @property
    def head_snic_addr(self) -> str:
        return _host(self.subnet, 2, 1)

    @property
    def bridges(self) -> tuple[str, str]:
        return (f"dp{self.name}c", f"dp{self.name}s")


@dataclass(frozen=True, slots=True)
class ClusterState:
    """A cluster that ``up`` made: its spec and when (unix seconds). JSON round-trips."""

    spec: ClusterSpec
    created_unix_s: float

    def address(self, node: str, nic: Nic) -> str:
        return self.spec.address(node, nic)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        raw = json.loads(text)
        spec = dict(raw["spec"])
        spec["nodes"] = tuple(Node(**n) for n in spec["nodes"])
        spec["rates"] = NicRates(**spec["rates"])
        return cls(ClusterSpec(**spec), float(raw["created_unix_s"]))

    @classmethod
    def load(cls, name: str) -> ClusterState:
        path = state_path(name)
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise ClusterError(
                f"no cluster {name!r} ({path} missing): run `dualpath cluster up --name {name}`"
            ) from None


def check_name(name: str) -> None:
    """ValueError naming ``name`` unless it is a cluster name, ``[a-z0-9]{1,6}``."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"name={name!r} is invalid: must match [a-z0-9]{{1,6}}")


def nics(node: Node) -> str:
    return "snic only" if not node.cnic_addr else "cnic and snic"


def default_subnet(name: str) -> ipaddress.IPv4Network:
    """``10.N.0.0/16`` with ``N = 100 + crc32(name) % 100``: deterministic per name."""
    return ipaddress.IPv4Network(f"10.{100 + zlib.crc32(name.encode()) % 100}.0.0/16")


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    """``A.B`` or ``A.B.0.0/16``, a private range; ValueError naming the value otherwise."""
    candidate = text if "/" in text else f"{text}.0.0/16" if text.count(".") == 1 else text
    try:
        net = ipaddress.IPv4Network(candidate)
    except ValueError:
        net = None
    if net is None or net.prefixlen != 16 or not net.is_private or net.is_loopback:
        raise ValueError(
            f"subnet={text!r} is invalid: must be a private /16 such as 10.150 or 10.150.0.0/16"
        )
    return net


def _host(subnet: str, network: int, host: int) -> str:
    base = ipaddress.IPv4Network(subnet).network_address
    return str(base + network * 256 + host)


def layout(name: str, net: ipaddress.IPv4Network, num_p: int, num_d: int) -> tuple[Node, ...]:
    """The nodes in order p0.., d0.., store, with their namespaces and addresses."""
    subnet = str(net)
    nodes = [_node(name, f"p{i}", "prefill", subnet, 10 + i) for i in range(num_p)]
    nodes += [_node(name, f"d{i}", "decode", subnet, 20 + i) for i in range(num_d)]
    nodes.append(Node("store", "store", f"dp-{name}-store", "", _host(subnet, 2, 254)))
    return tuple(nodes)


def _node(cluster: str, node: str, kind: NodeKind, subnet: str, host: int) -> Node:
    return Node(node, kind, f"dp-{cluster}-{node}", _host(subnet, 1, host), _host(subnet, 2, host))


def state_path(name: str) -> Path:
    check_name(name)
    return Path(os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR) / f"{name}.json"


def tbf_args(dev: str, rate_bytes_per_s: float, ns: str | None = None) -> list[str]:
    """``tc`` argv for a token bucket on ``dev``'s egress (in namespace ``ns``) at the rate.

    burst = max(32 KiB, 4 ms at the rate): deep enough for the timer and GSO packets, small
    enough that a flow longer than a few ms sees the rate. latency 50 ms bounds the queue
    (rate × 50 ms + burst bytes); beyond it packets drop, which TCP takes as congestion.
    """
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * TBF_BURST_S))
    return [
        "tc",
        *(["-n", ns] if ns else []),
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{int(rate_bytes_per_s * 8)}bit",
        "burst",
        str(burst),
        "latency",
        f"{TBF_LATENCY_MS}ms",
    ]


def plan(spec: ClusterSpec) -> list[list[str]]:
    """Every command ``up`` runs, in order (pure: no I/O)."""
    cmds: list[list[str]] = []
    for bridge, net in zip(spec.bridges, (1, 2), strict=True):
        cmds += [
            ["ip", "link", "add", bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{_host(spec.subnet, net, 1)}/24", "dev", bridge],
            ["ip", "link", "set", bridge, "up"],
        ]
    for node in spec.nodes:
        ns = node.namespace
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            # as a datacenter host (and RDMA, which has no slow start): a connection idle
            # for a moment keeps its window (Linux's default restarts slow start after
            # one RTO idle: every block fetched after a pause would take several RTTs)
            [
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-q",
                "-w",
                "net.ipv4.tcp_slow_start_after_idle=0",
            ],
        ]
        for nic, bridge in zip(("cnic", "snic"), spec.bridges, strict=True):
            addr = node.cnic_addr if nic == "cnic" else node.snic_addr
            if not addr:
                continue
            peer = f"dp{spec.name}-{node.name}{nic[0]}"
            cmds += [
                ["ip", "link", "add", peer, "type", "veth", "peer", "name", nic, "netns", ns],
                ["ip", "link", "set", peer, "master", bridge, "up"],
                ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", nic],
                ["ip", "-n", ns, "link", "set", nic, "up"],
            ]
            rate = spec.rate_bytes_per_s(node.name, nic)  # type: ignore[arg-type]
            if nic == "cnic":
                cmds += cnic_shaping(spec, node, spec.traffic_manager)
            elif rate > 0:  # (the SNIC) its control packets ahead of bulk data
                cmds += [
                    *tc_small_first_commands(nic, rate, ns),
                    *tc_small_first_commands(peer, rate),
                ]
    return cmds


def cnic_shaping(spec: ClusterSpec, node: Node, traffic_manager: bool) -> list[list[str]]:
    """``tc`` argv shaping both ends of ``node``'s CNIC: the traffic manager's two classes,
    or one queue (``tbf``); none for a node without a CNIC or an unshaped one."""
    rate = spec.rate_bytes_per_s(node.name, "cnic") if node.cnic_addr else 0.0
    if rate <= 0:
        return []
    ends = [("cnic", node.namespace), (f"dp{spec.name}-{node.name}c", None)]
    if not traffic_manager:
        return [tbf_args(dev, rate, ns) for dev, ns in ends]
    return [argv for dev, ns in ends for argv in tc_commands(QosOptions(), dev, rate, ns)]


def set_traffic_manager(name: str, on: bool) -> ClusterState:
    """Switch every CNIC of cluster ``name`` to the two classes (``on``) or back to one
    queue, at the same rates; the state file records it."""
    _require_namespaces()
    state = ClusterState.load(name)
    spec = dataclasses.replace(state.spec, traffic_manager=on)
    for node in spec.nodes:
        for argv in cnic_shaping(spec, node, on):
            _run(argv)
    new = ClusterState(spec, state.created_unix_s)
    _write_state(new)
    return new


@functools.cache
def can_make_namespaces() -> str | None:
    """None if this process can make network namespaces (tried once), else a one-line reason."""
    if os.geteuid() != 0:
        return "a cluster on one host needs root (network namespaces, bridges, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"a cluster on one host needs iproute2's `{tool}`, which is not on PATH"
    probe = f"dp-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _require_namespaces() -> None:
    reason = can_make_namespaces()
    if reason is not None:
        raise ClusterError(reason)


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _namespaces(name: str) -> list[str]:
    out = _run(["ip", "-j", "netns", "list"]).strip()
    prefix = f"dp-{name}-"
    return sorted(n["name"] for n in json.loads(out or "[]") if n["name"].startswith(prefix))


def _root_links(name: str) -> list[str]:
    """Root-namespace links of cluster ``name``: its two bridges and veth peers."""
    bridges = {f"dp{name}c", f"dp{name}s"}
    links = json.loads(_run(["ip", "-j", "link", "show"]) or "[]")
    return sorted(
        link["ifname"]
        for link in links
        if link["ifname"] in bridges or link["ifname"].startswith(f"dp{name}-")
    )


def _check_free(spec: ClusterSpec) -> None:
    if state_path(spec.name).exists() or _namespaces(spec.name) or _root_links(spec.name):
        raise ClusterError(
            f"cluster {spec.name!r} exists: run `dualpath cluster down --name {spec.name}` "
            "(or `cluster up --replace`)"
        )
    net = ipaddress.IPv4Network(spec.subnet)
    for route in json.loads(_run(["ip", "-j", "route", "show"]) or "[]"):
        dst = route.get("dst", "default")
        if dst != "default" and ipaddress.IPv4Network(dst, strict=False).overlaps(net):
            raise ClusterError(
                f"subnet {spec.subnet} overlaps the route {dst} on this host: pick another "
                "with --subnet"
            )


def up(spec: ClusterSpec, replace: bool = False) -> ClusterState:
    """Make the cluster and write its state file; on any failure remove what was made."""
    _require_namespaces()
    if replace:
        down(spec.name)
    _check_free(spec)
    try:
        for argv in plan(spec):
            _run(argv)
        state = ClusterState(spec, time.time())
        _write_state(state)
    except BaseException:
        down(spec.name)
        raise
    return state


def _write_state(state: ClusterState) -> None:
    path = state_path(state.spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(path)


def _pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return sorted(int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid())


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop_processes(ns: str) -> list[int]:
    """SIGTERM every process in ``ns``, wait ≤ 5 s, SIGKILL what is left; the pids found."""
    found = _pids(ns)
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + KILL_WAIT_S
    while _pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(_pids(ns), signal.SIGKILL)
    deadline = time.monotonic() + 1.0
    while _pids(ns) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def down(name: str) -> list[str]:
    """Remove cluster ``name`` and what a crashed run left of it (no state file needed):
    processes and namespaces ``dp-NAME-*``, its bridges and veth peers, the state file and
    ``/dev/shm/dpNAME-*``. Idempotent; returns what it removed, one item per string."""
    check_name(name)
    _require_namespaces()
    removed: list[str] = []
    namespaces = _namespaces(name)
    for ns in namespaces:
        removed += [f"process {pid}" for pid in _stop_processes(ns)]
    # veths first: deleting one end removes both at once, while a namespace's are deleted
    # asynchronously by the kernel after `ip netns del` returns
    for link in _root_links(name):
        done = subprocess.run(["ip", "link", "del", link], capture_output=True)
        if done.returncode == 0:
            removed.append(f"link {link}")
    for ns in namespaces:
        _run(["ip", "netns", "del", ns])
        removed.append(f"netns {ns}")
    path = state_path(name)
    for file in [path, *sorted(SHM_DIR.glob(f"dp{name}-*"))]:
        try:
            file.unlink()
            removed.append(f"file {file}")
        except FileNotFoundError:
            pass
    return removed


def _counters(ns: str) -> dict[str, dict[str, int]]:
    links = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show"]) or "[]")
    return {
        link["ifname"]: {
            "rx_bytes": int(link["stats64"]["rx"]["bytes"]),
            "tx_bytes": int(link["stats64"]["tx"]["bytes"]),
        }
        for link in links
        if link["ifname"] in ("cnic", "snic")
    }


def status(name: str) -> dict[str, Any]:
    """The cluster as JSON-ready data: nodes, kinds, namespaces, addresses, rates (bytes/s,
    0 = unshaped) and the kernel's byte counters of each NIC (node side: tx = node → net)."""
    _require_namespaces()
    state = ClusterState.load(name)
    spec = state.spec
    alive = set(_namespaces(name))
    nodes = []
    for node in spec.nodes:
        counters = _counters(node.namespace) if node.namespace in alive else {}
        entry: dict[str, Any] = {
            "node": node.name,
            "kind": node.kind,
            "namespace": node.namespace,
            "up": node.namespace in alive,
        }
        for nic in ("cnic", "snic"):
            addr = node.cnic_addr if nic == "cnic" else node.snic_addr
            if addr:
                entry[nic] = {
                    "addr": addr,
                    "rate_bytes_per_s": spec.rate_bytes_per_s(node.name, nic),
                    **counters.get(nic, {"rx_bytes": 0, "tx_bytes": 0}),
                }
        nodes.append(entry)
    return {
        "name": spec.name,
        "preset": spec.preset,
        "subnet": spec.subnet,
        "head": {"cnic": spec.head_cnic_addr, "snic": spec.head_snic_addr},
        "bridges": list(spec.bridges),
        "rates": asdict(spec.rates),
        "traffic_manager": spec.traffic_manager,
        "created_unix_s": state.created_unix_s,
        "nodes": nodes,
    }


def node_argv(state: ClusterState, node: str, argv: list[str]) -> list[str]:
    """``argv`` run inside ``node``'s namespace: ``["ip", "netns", "exec", ns, *argv]``."""
    return ["ip", "netns", "exec", state.spec.node(node).namespace, *argv]


def popen(state: ClusterState, node: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside ``node``'s namespace; ``kw`` as for ``subprocess.Popen``."""
    return subprocess.Popen(node_argv(state, node, argv), **kw)
