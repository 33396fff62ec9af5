"""The traffic manager on real packets (Linux tc): the two classes' commands, and on a one-host
cluster a marked ping-pong that keeps its latency beside saturating bulk traffic with the
classes and loses it with one queue. Tests that need root and namespaces skip without."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from dualpath.cli.main import main
from dualpath.deploy import cluster
from dualpath.deploy.cluster import ClusterSpec, ClusterState
from dualpath.deploy.qos import QosOptions, tc_commands, tc_remove_commands

REASON = cluster.can_make_namespaces()
needs_ns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PY = sys.executable
PORT = 9000
# the ping-pong's p99 beside saturating bulk traffic may exceed its idle p99 by at most this
# much: one bulk packet ahead of it (a 64 KiB GSO segment is 4.1 ms at 128 Mbit/s, but the
# shaper's burst lets the high class through sooner) plus scheduling noise on a busy 2-core
# host; one queue holds the bulk flow's standing queue (~80 kB = 5 ms at 128 Mbit/s) instead
BOUND_FACTOR, BOUND_SLACK_US = 3.0, 1000.0


def test_tc_commands_realise_the_arbiter() -> None:
    opt = QosOptions()  # low_share 0.01, collectives DSCP 26
    cmds = [" ".join(argv) for argv in tc_commands(opt, "cnic", 100e6 / 8, "ns1")]
    assert all(c.startswith("tc -n ns1 ") for c in cmds)
    assert "root handle 1: htb default 20" in cmds[0]
    assert "classid 1:10 htb rate 99000000bit prio 0 ceil 100000000bit" in cmds[2]
    assert "classid 1:20 htb rate 1000000bit prio 1 ceil 100000000bit" in cmds[3]
    assert "bfifo limit 625000" in cmds[5]  # the low queue: 50 ms at the rate, as tbf's
    assert "match ip dsfield 0x68 0xfc flowid 1:10" in cmds[6]  # DSCP 26 << 2
    assert "match u16 0x680 0x0fc0 at 0 flowid 1:10" in cmds[7]  # IPv6 traffic class
    ef = tc_commands(QosOptions(collective_dscp=46), "eth0", 1e9 / 8)
    assert "match ip dsfield 0xb8 0xfc" in " ".join(ef[6])
    assert tc_remove_commands("eth0") == [["tc", "qdisc", "del", "dev", "eth0", "root"]]


def test_cli_dry_run_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["qos", "--apply", "--iface", "eth9", "--rate-mbit", "100", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/sh\n") and out.count("\ntc ") == 8
    assert "rate 99000000bit" in out
    assert main(["qos", "--remove", "--iface", "eth9", "--dry-run"]) == 0
    assert capsys.readouterr().out.endswith("tc qdisc del dev eth9 root\n")
    for argv, needle in [
        (["qos", "--dry-run"], "go with --apply or --remove"),
        (["qos", "--apply"], "need --iface"),
        (["qos", "--apply", "--iface", "eth9", "--rate-mbit", "0", "--dry-run"], "--rate-mbit"),
        (["qos", "--apply", "--cluster", "zz", "--iface", "x"], "drop --iface"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


@pytest.fixture
def qos_cluster() -> Iterator[ClusterState]:
    # CNIC 128 Mbit/s: low enough that this host's Python saturates it with one flow
    spec = ClusterSpec.from_preset(
        "tiny-1p1d", name=f"q{time.time_ns() % 10**5}", cnic_cap_mbit=128.0
    )
    state = cluster.up(spec)
    try:
        yield state
    finally:
        cluster.down(spec.name)


def _probe(state: ClusterState, node: str, *argv: str) -> subprocess.Popen[str]:
    cmd = [PY, "-m", "dualpath.deploy.qosprobe", *argv]
    return cluster.popen(state, node, cmd, stdout=subprocess.PIPE, text=True)


def _ping_p99(state: ClusterState, to: str, bulk: bool) -> tuple[float, float]:
    """(p99 µs of marked 4 KiB round trips p0 → d0, bulk Mbit/s); with ``bulk``, an unmarked
    flow p0 → d0 fills p0's CNIC meanwhile."""
    load = _probe(state, "p0", "bulk", "--to", to, "--seconds", "3.5") if bulk else None
    if load:
        time.sleep(1.0)  # past slow start: the queue is standing
    ping = _probe(state, "p0", "pingpong", "--to", to, "--dscp", "26", "--seconds", "2")
    out, _ = ping.communicate(timeout=30)
    rate = json.loads(load.communicate(timeout=30)[0])["mbit_per_s"] if load else 0.0
    return json.loads(out)["p99_us"], rate


@needs_ns
def test_classes_keep_marked_latency_beside_bulk_and_one_queue_does_not(
    qos_cluster: ClusterState, capsys: pytest.CaptureFixture[str]
) -> None:
    state = qos_cluster
    name = state.spec.name
    d0 = state.address("d0", "cnic")
    server = _probe(state, "d0", "server", "--host", d0, "--port", str(PORT), "--dscp", "26")
    try:
        assert server.stdout is not None and "listening" in server.stdout.readline()
        to = f"{d0}:{PORT}"
        assert main(["qos", "--apply", "--cluster", name]) == 0
        assert ClusterState.load(name).spec.traffic_manager
        shown = subprocess.run(
            ["tc", "-n", state.spec.node("p0").namespace, "qdisc", "show", "dev", "cnic"],
            capture_output=True,
            text=True,
        ).stdout
        assert "htb" in shown and "tbf" not in shown
        idle, _ = _ping_p99(state, to, bulk=False)
        bound = max(BOUND_FACTOR * idle, idle + BOUND_SLACK_US)
        classes, rate_classes = _ping_p99(state, to, bulk=True)
        assert main(["qos", "--remove", "--cluster", name]) == 0
        assert not ClusterState.load(name).spec.traffic_manager
        one_queue, rate_one = _ping_p99(state, to, bulk=True)
        capsys.readouterr()
        print(
            f"p99 µs: idle {idle:.0f}, classes {classes:.0f}, one queue {one_queue:.0f}; "
            f"bulk Mbit/s {rate_classes:.1f} / {rate_one:.1f}"
        )
        assert rate_classes > 0.8 * 128 and rate_one > 0.8 * 128  # the bulk flow saturates
        assert classes <= bound, f"classes: p99 {classes:.0f} µs > bound {bound:.0f} µs"
        assert one_queue > bound, f"one queue: p99 {one_queue:.0f} µs <= bound {bound:.0f} µs"
    finally:
        server.kill()
        server.wait()


def test_cluster_plan_puts_the_classes_on_cnics_only() -> None:
    one = cluster.plan(ClusterSpec.from_preset("tiny-1p1d", name="pq"))
    two = cluster.plan(ClusterSpec.from_preset("tiny-1p1d", name="pq", traffic_manager=True))

    def shaping(cmds: list[list[str]], dev: str) -> set[str]:
        return {c[c.index("root") + 1] for c in cmds if c[0] == "tc" and dev in c and "root" in c}

    for dev in ("dppq-p0c", "dppq-d0c"):  # bridge ends of the CNICs
        assert shaping(one, dev) == {"tbf"} and shaping(two, dev) == {"handle"}  # htb root
    for cmds in (one, two):  # SNICs: small packets first, at the same rate, either way
        assert shaping(cmds, "dppq-p0s") == {"handle"}


@needs_ns
def test_an_snic_sends_small_packets_ahead_of_bulk_data() -> None:
    """A storage NIC as the cluster shapes it: 64-byte round trips p0 → storage host keep their
    latency while a bulk flow fills p0's SNIC the same way (a read's acknowledgements beside a
    write, the store's RPCs beside a put); with one FIFO (tbf) they wait behind its queue."""
    spec = ClusterSpec.from_preset("tiny-1p1d", name=f"s{time.time_ns() % 10**5}", snic_mbit=16.0)
    state = cluster.up(spec)
    try:
        store = state.address("store", "snic")
        server = _probe(state, "store", "server", "--host", store, "--port", str(PORT))
        try:
            assert server.stdout is not None and "listening" in server.stdout.readline()
            to = f"{store}:{PORT}"

            def p99(bulk: bool) -> float:
                load = _probe(state, "p0", "bulk", "--to", to, "--seconds", "4") if bulk else None
                if load:
                    time.sleep(1.5)  # past slow start: the queue is standing
                ping = _probe(
                    state,
                    "p0",
                    "pingpong",
                    "--to",
                    to,
                    "--size",
                    "64",
                    "--seconds",
                    "2",
                    "--interval-s",
                    "0.01",
                )
                out, _ = ping.communicate(timeout=30)
                if load:
                    load.communicate(timeout=30)
                return float(json.loads(out)["p99_us"])

            idle = p99(False)
            bound = max(BOUND_FACTOR * idle, idle + 5000.0)  # 5 ms: one 2 MB/s burst's worth
            small_first = p99(True)
            ns = spec.node("p0").namespace
            subprocess.run(
                cluster.tbf_args("snic", spec.rate_bytes_per_s("p0", "snic"), ns), check=True
            )
            one_queue = p99(True)
            print(
                f"p99 µs: idle {idle:.0f}, small first {small_first:.0f}, one queue {one_queue:.0f}"
            )
            assert small_first <= bound, f"small first: p99 {small_first:.0f} µs > {bound:.0f} µs"
            assert one_queue > bound, f"one queue: p99 {one_queue:.0f} µs <= {bound:.0f} µs"
        finally:
            server.kill()
            server.wait()
    finally:
        cluster.down(spec.name)
