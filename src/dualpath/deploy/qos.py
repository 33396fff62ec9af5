"""NIC/switch QoS configuration that realises the traffic manager (design §6).

Two priority classes on every compute NIC: model collectives (high) and KV traffic (low,
never starved). InfiniBand realises them with virtual lanes and the two-level VL arbiter
(IBA 7.6.9) configured through OpenSM; RoCE with DSCP → priority → traffic class and ETS
weights (``mlnx_qos``). Pure text generation: no I/O, no subprocesses.

Arithmetic (docs/operations.md):
- IB VL arbitration weights count 64-byte units; the high limit counts 4096-byte units of
  high-priority data sent before one low-priority packet gets its turn (255 = unlimited).
  With collectives always backlogged, KV keeps at least ``mtu / (high_limit·4096 + mtu)``
  of the link; when collectives idle it takes the whole link.
- RoCE ETS weights are whole percentages over the ETS traffic classes; KV's class gets
  ``round(100·low_share)`` (≥ 1) and the collective classes split the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpath.config.checks import require

IB_CREDIT_BYTES = 4096  # unit of the VL arbiter's high limit (IBA 7.6.9)
IB_HIGH_LIMIT_UNLIMITED = 255
IB_NUM_SLS = 16
NUM_PRIORITIES = 8  # IEEE 802.1p priorities / mlnx_qos traffic classes
PAPER_HIGH_LIMIT = 240  # the paper's OpenSM qos_high_limit (design §6)
PAPER_WEIGHT = 192  # weight of each collective VL in both tables (design §6)
PAPER_KV_LOW_WEIGHT = 64  # weight of the KV VL in the low table (design §6)
COLLECTIVE_DSCP = 26  # AF31: RoCE v2's usual DSCP, priority 3 under the default map


@dataclass(frozen=True, slots=True)
class QosOptions:
    """What the fabric configuration is derived from.

    ``num_vls`` lanes (= lossless RoCE classes) are used; lane ``kv_lane`` carries KV
    traffic (low priority), every other lane carries collectives (high priority), SL i maps
    to VL i. ``high_limit`` is the IB arbiter's high limit (the paper's 240 by default);
    ``None`` derives it from ``low_share``. ``low_share`` is the KV class's guaranteed share
    of a busy link (the simulator's ``sim.low_floor``); on RoCE it sets the ETS weights.
    """

    num_vls: int = 4
    kv_lane: int = 2
    high_limit: int | None = PAPER_HIGH_LIMIT
    collective_weight: int = PAPER_WEIGHT
    kv_low_weight: int = PAPER_KV_LOW_WEIGHT
    low_share: float = 0.01
    mtu_bytes: int = 4096
    collective_dscp: int = COLLECTIVE_DSCP
    kv_dscp: int = 16  # CS2: priority 2 under the default map
    iface: str = "IFACE"

    def __post_init__(self) -> None:
        require(2 <= self.num_vls <= 8, "qos.num_vls", self.num_vls, "an integer in [2, 8]")
        require(
            0 <= self.kv_lane < self.num_vls,
            "qos.kv_lane",
            self.kv_lane,
            f"a lane in [0, {self.num_vls - 1}]",
        )
        if self.high_limit is not None:
            require(
                0 <= self.high_limit <= IB_HIGH_LIMIT_UNLIMITED,
                "qos.high_limit",
                self.high_limit,
                "an integer in [0, 255] (255 = unlimited)",
            )
        for name in ("collective_weight", "kv_low_weight"):
            value = getattr(self, name)
            require(1 <= value <= 255, f"qos.{name}", value, "an integer in [1, 255]")
        require(
            math.isfinite(self.low_share) and 0 < self.low_share < 0.5,
            "qos.low_share",
            self.low_share,
            "in (0, 0.5): KV is the low-priority class",
        )
        require(
            self.mtu_bytes in (256, 512, 1024, 2048, 4096),
            "qos.mtu_bytes",
            self.mtu_bytes,
            "an IB MTU: 256, 512, 1024, 2048 or 4096",
        )
        for name in ("collective_dscp", "kv_dscp"):
            value = getattr(self, name)
            require(0 <= value <= 63, f"qos.{name}", value, "a DSCP value in [0, 63]")
        require(
            self.collective_dscp != self.kv_dscp,
            "qos.kv_dscp",
            self.kv_dscp,
            "different from qos.collective_dscp",
        )
        require(
            bool(self.iface) and not any(c.isspace() for c in self.iface),
            "qos.iface",
            self.iface,
            "an interface name without spaces",
        )

    @property
    def collective_lanes(self) -> tuple[int, ...]:
        return tuple(vl for vl in range(self.num_vls) if vl != self.kv_lane)

    @property
    def ib_high_limit(self) -> int:
        """The high limit to configure: given, or the smallest one keeping ``low_share``."""
        if self.high_limit is not None:
            return self.high_limit
        units = self.mtu_bytes * (1 - self.low_share) / self.low_share / IB_CREDIT_BYTES
        return max(0, min(IB_HIGH_LIMIT_UNLIMITED - 1, math.floor(units + 1e-9)))


def ib_low_share_floor(high_limit: int, mtu_bytes: int) -> float:
    """KV's guaranteed share of a link whose collectives never idle (0 if unlimited)."""
    if high_limit >= IB_HIGH_LIMIT_UNLIMITED:
        return 0.0
    high = max(high_limit * IB_CREDIT_BYTES, mtu_bytes)  # limit 0: one high packet per turn
    return mtu_bytes / (high + mtu_bytes)


def _vlarb(entries: list[tuple[int, int]]) -> str:
    return ",".join(f"{vl}:{w}" for vl, w in entries)


def opensm_conf(opt: QosOptions) -> str:
    """``opensm.conf`` lines (``qos_*``) for every port: CAs, switches, routers."""
    high = [(vl, 0 if vl == opt.kv_lane else opt.collective_weight) for vl in range(opt.num_vls)]
    low = [
        (vl, opt.kv_low_weight if vl == opt.kv_lane else opt.collective_weight)
        for vl in range(opt.num_vls)
    ]
    sl2vl = [sl if sl < opt.num_vls else opt.collective_lanes[0] for sl in range(IB_NUM_SLS)]
    limit = opt.ib_high_limit
    floor = ib_low_share_floor(limit, opt.mtu_bytes)
    sls = ",".join(str(v) for v in opt.collective_lanes)
    return "\n".join(
        [
            "# dualpath traffic manager (arXiv 2602.21548 §5) for OpenSM: add to opensm.conf, start with --qos",
            f"# collectives: SL {sls} -> high-priority VLs {sls}; KV traffic: SL {opt.kv_lane} -> "
            f"VL {opt.kv_lane} (low table only)",
            f"# KV keeps >= {100 * floor:.2f}% of a link whose collectives never idle "
            f"(MTU {opt.mtu_bytes} B, high limit {limit} x 4096 B), all of it when they idle",
            "qos TRUE",
            f"qos_max_vls {opt.num_vls}",
            f"qos_high_limit {limit}",
            f"qos_vlarb_high {_vlarb(high)}",
            f"qos_vlarb_low {_vlarb(low)}",
            f"qos_sl2vl {','.join(str(v) for v in sl2vl)}",
            "",
        ]
    )


def ets_weights(opt: QosOptions) -> list[int]:
    """Per traffic class 0..7: whole percentages summing to 100 over the used classes."""
    kv = max(1, round(100 * opt.low_share))
    lanes = opt.collective_lanes
    share, extra = divmod(100 - kv, len(lanes))
    weights = [0] * NUM_PRIORITIES
    weights[opt.kv_lane] = kv
    for i, tc in enumerate(lanes):
        weights[tc] = share + (1 if i < extra else 0)
    return weights


def roce_commands(opt: QosOptions) -> str:
    """``mlnx_qos`` commands for one RoCE NIC (run per compute NIC; switches: same map)."""
    n = opt.num_vls
    collective_prio = opt.collective_dscp >> 3  # the default DSCP → priority map
    kv_prio = opt.kv_dscp >> 3
    pfc = ",".join("1" if p < n else "0" for p in range(NUM_PRIORITIES))
    prio_tc = [p if p < n else opt.collective_lanes[0] for p in range(NUM_PRIORITIES)]
    prio_tc[collective_prio] = opt.collective_lanes[-1]
    prio_tc[kv_prio] = opt.kv_lane
    weights = ets_weights(opt)
    i = opt.iface
    return "\n".join(
        [
            "#!/bin/sh",
            "# dualpath traffic manager (arXiv 2602.21548 §5) for RoCE (NVIDIA/Mellanox mlnx_qos): run per CNIC",
            f"# collectives: DSCP {opt.collective_dscp} -> priority {collective_prio} -> TC "
            f"{prio_tc[collective_prio]}; KV traffic: DSCP {opt.kv_dscp} -> priority {kv_prio} -> "
            f"TC {opt.kv_lane} (ETS {weights[opt.kv_lane]}%)",
            f"# {n} lossless classes (PFC on priorities 0-{n - 1}); switches need the same DSCP map,",
            "# PFC and ETS weights on every port.",
            "set -e",
            f"mlnx_qos -i {i} --trust dscp",
            f"mlnx_qos -i {i} --dscp2prio set,{opt.collective_dscp},{collective_prio}",
            f"mlnx_qos -i {i} --dscp2prio set,{opt.kv_dscp},{kv_prio}",
            f"mlnx_qos -i {i} --pfc {pfc}",
            f"mlnx_qos -i {i} --prio_tc {','.join(str(t) for t in prio_tc)}",
            f"mlnx_qos -i {i} --tsa {','.join(['ets'] * NUM_PRIORITIES)} "
            f"--tcbw {','.join(str(w) for w in weights)}",
            "",
        ]
    )


def app_settings(opt: QosOptions) -> str:
    """How traffic gets into its class: environment of the engines' libraries."""
    sl = opt.collective_lanes[0]
    return "\n".join(
        [
            "# Marking traffic (per engine process)",
            f"# InfiniBand: collectives on SL {sl} (NCCL_IB_SL={sl}; DeepEP/NVSHMEM: "
            f"NVSHMEM_IB_SL={sl}); KV transfers on SL {opt.kv_lane} (the KV transport's QP "
            "service level).",
            f"# RoCE: collectives ToS {opt.collective_dscp << 2} (NCCL_IB_TC="
            f"{opt.collective_dscp << 2}); KV transfers ToS {opt.kv_dscp << 2} "
            f"(DSCP {opt.kv_dscp}).",
            "",
        ]
    )


def render(opt: QosOptions, fabric: str) -> str:
    """The configuration for ``fabric``: ``ib``, ``roce`` or ``both``."""
    require(fabric in ("ib", "roce", "both"), "--fabric", fabric, "one of ib, roce, both")
    parts = []
    if fabric in ("ib", "both"):
        parts.append(opensm_conf(opt))
    if fabric in ("roce", "both"):
        parts.append(roce_commands(opt))
    parts.append(app_settings(opt))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------- Linux tc
# The same arbiter on a Linux host's egress: an HTB root shaped to the link rate, a high
# class guaranteed (1 - low_share) of it with prio 0 (it borrows first), a low class
# guaranteed low_share with prio 1, both allowed the whole link (ceil); a u32 filter sends
# the collectives' DSCP to the high class, everything else falls into the low one (KV needs
# no marking: the default class is its class).
TC_HIGH, TC_LOW = 10, 20  # minor class ids under handle 1:
TC_QUANTUM_BYTES = 60_000  # DRR quantum; within HTB's accepted [1000, 200000]
TC_BURST_S = 0.004  # bucket depth, as the cluster's tbf: 4 ms at the rate, >= 32 KiB
TC_MIN_BURST_BYTES = 32 * 1024
TC_LOW_QUEUE_S = 0.05  # the low class's queue holds 50 ms at the link rate (as tbf's latency)
TC_HIGH_QUEUE_PACKETS = 1000  # collectives are paced by their own lockstep: never deep


def _tc(netns: str | None, line: str) -> list[str]:
    """``tc [-n NETNS] LINE...`` as argv (``line``: words separated by spaces)."""
    return ["tc", *(["-n", netns] if netns else []), *line.split()]


def tc_commands(
    opt: QosOptions, iface: str, rate_bytes_per_s: float, netns: str | None = None
) -> list[list[str]]:
    """``tc`` argv that realise the two classes on ``iface``'s egress at the link rate."""
    tos = f"0x{opt.collective_dscp << 2:02x}"
    tclass = f"0x{opt.collective_dscp << 6:03x}"  # IPv6 traffic class sits 4 bits higher
    filters = [
        f"protocol ip prio 1 u32 match ip dsfield {tos} 0xfc",
        f"protocol ipv6 prio 2 u32 match u16 {tclass} 0x0fc0 at 0",
    ]
    return two_classes(iface, rate_bytes_per_s, 1 - opt.low_share, filters, netns)


# A storage NIC's egress on the one-host cluster: its control packets first. Every read's TCP
# acknowledgements leave through the write direction and every write's through the read
# direction, as do the store's small RPCs (replica lists, put start / end); behind 50 ms of
# bulk data in one FIFO, an acknowledgement delayed that long throttles the flow it clocks,
# and every RPC waits as long. A real storage NIC is not a 2 MB/s FIFO (RDMA acknowledges in
# hardware; its queues drain in microseconds): packets of an IPv4 length under
# ``SNIC_SMALL_BYTES`` get a class of their own with prio 0, bulk data the rest.
SNIC_SMALL_BYTES = 512  # pure ACKs are 52 bytes, the store's RPCs a few hundred; MSS 1,448
SNIC_SMALL_SHARE = 0.05  # guaranteed to the small packets (ACKs of a full link: ≈ 3%)


def tc_small_first_commands(
    iface: str, rate_bytes_per_s: float, netns: str | None = None
) -> list[list[str]]:
    """``tc`` argv that shape ``iface``'s egress to the link rate, small packets first."""
    mask = 0xFFFF & ~(SNIC_SMALL_BYTES - 1)  # the IPv4 total length's bits at or above it
    filters = [f"protocol ip prio 1 u32 match u16 0x0000 0x{mask:04x} at 2"]
    return two_classes(iface, rate_bytes_per_s, SNIC_SMALL_SHARE, filters, netns)


def two_classes(
    iface: str,
    rate_bytes_per_s: float,
    high_share: float,
    filters: list[str],
    netns: str | None = None,
) -> list[list[str]]:
    """``tc`` argv of an HTB root at the link rate over a high class (guaranteed
    ``high_share`` of it, prio 0) and a low class (the rest, prio 1, the default), both
    allowed the whole link; ``filters`` (``tc filter`` selectors) send packets to the high
    class."""
    require(
        rate_bytes_per_s > 0 and math.isfinite(rate_bytes_per_s),
        "--rate-mbit",
        rate_bytes_per_s * 8 / 1e6,
        "a positive link rate",
    )
    require(bool(iface) and not any(c.isspace() for c in iface), "--iface", iface, "a name")
    rate = int(rate_bytes_per_s * 8)  # bit/s
    high = max(1, round(rate * high_share))
    low = max(1, rate - high)
    burst = max(TC_MIN_BURST_BYTES, int(rate_bytes_per_s * TC_BURST_S))
    queue = max(TC_MIN_BURST_BYTES, int(rate_bytes_per_s * TC_LOW_QUEUE_S))
    r2q = max(1, math.ceil(rate_bytes_per_s / 200_000))  # the root class's quantum <= 200 kB
    dev = f"dev {iface}"
    leaf = f"ceil {rate}bit burst {burst} cburst {burst} quantum {TC_QUANTUM_BYTES}"
    return [
        _tc(netns, f"qdisc replace {dev} root handle 1: htb default {TC_LOW} r2q {r2q}"),
        _tc(
            netns,
            f"class replace {dev} parent 1: classid 1:1 htb rate {rate}bit "
            f"ceil {rate}bit burst {burst} cburst {burst}",
        ),
        _tc(
            netns,
            f"class replace {dev} parent 1:1 classid 1:{TC_HIGH} htb rate {high}bit prio 0 {leaf}",
        ),
        _tc(
            netns,
            f"class replace {dev} parent 1:1 classid 1:{TC_LOW} htb rate {low}bit prio 1 {leaf}",
        ),
        _tc(
            netns,
            f"qdisc replace {dev} parent 1:{TC_HIGH} handle {TC_HIGH}: pfifo "
            f"limit {TC_HIGH_QUEUE_PACKETS}",
        ),
        _tc(netns, f"qdisc replace {dev} parent 1:{TC_LOW} handle {TC_LOW}: bfifo limit {queue}"),
        *(_tc(netns, f"filter replace {dev} parent 1: {f} flowid 1:{TC_HIGH}") for f in filters),
    ]


def tc_remove_commands(iface: str, netns: str | None = None) -> list[list[str]]:
    """``tc`` argv that drop the classes (the interface's default qdisc comes back)."""
    return [_tc(netns, f"qdisc del dev {iface} root")]


def tc_script(commands: list[list[str]], header: str) -> str:
    """Commands as a shell script (``--dry-run``)."""
    import shlex

    lines = ["#!/bin/sh", header, "set -e"]
    lines += [shlex.join(argv) for argv in commands]
    return "\n".join(lines) + "\n"


def run_commands(commands: list[list[str]]) -> None:
    """Run ``tc`` argv in order; ValueError with the failing command and tc's message."""
    import subprocess

    for argv in commands:
        try:
            done = subprocess.run(argv, capture_output=True, text=True)
        except FileNotFoundError:
            raise ValueError("`tc` (iproute2) is not on PATH") from None
        if done.returncode != 0:
            msg = done.stderr.strip().splitlines()
            raise ValueError(f"`{' '.join(argv)}` failed: {msg[-1] if msg else done.returncode}")
