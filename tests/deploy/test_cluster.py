"""`dualpath cluster`: namespaces, bridges and addresses made and removed, NIC rates enforced by
the kernel, the CLI's one-line refusals. Tests that need root and namespaces skip without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.cli.main import main
from dualpath.deploy import cluster
from dualpath.deploy.cluster import ClusterSpec, ClusterState

REASON = cluster.can_make_namespaces()
needs_ns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
PY = sys.executable

# ICMP echo from inside a namespace (no dependency on iputils' ping): exit 0 iff a reply came
PING = """
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    return ~(s + (s >> 16)) & 0xFFFF
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(1.0)
ident = os.getpid() & 0xFFFF
body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"dualpath"
s.sendto(body[:2] + struct.pack("!H", csum(body)) + body[4:], (sys.argv[1], 0))
deadline = time.monotonic() + 1.0
while time.monotonic() < deadline:
    try:
        data, (src, _) = s.recvfrom(2048)
    except TimeoutError:
        break
    icmp = data[(data[0] & 0x0F) * 4:]
    if src == sys.argv[1] and icmp[0] == 0 and struct.unpack("!H", icmp[4:6])[0] == ident:
        sys.exit(0)
sys.exit(1)
"""

# TCP sink: accept one connection, read to EOF, print the bytes read
SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = srv.accept()
n = 0
while chunk := conn.recv(1 << 16):
    n += len(chunk)
print(n, flush=True)
"""

# TCP source: connect, send argv[3] bytes, print the seconds it took until the peer closed
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.monotonic()
c.sendall(b"x" * int(sys.argv[3]))
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(time.monotonic() - t0, flush=True)
"""


def _name() -> str:
    return f"t{os.getpid() % 10000:04d}{time.monotonic_ns() % 10}"


def _free_subnet() -> str:
    """A /16 in 10.200-10.254 that no route of this host overlaps (other clusters may be up)."""
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    used = {int(w.split(".")[1]) for w in routes.split() if w.startswith("10.") and "." in w[3:]}
    return f"10.{min(set(range(200, 255)) - used)}"


def _spec(name: str, snic_mbit: float = 16) -> ClusterSpec:
    return ClusterSpec.from_preset(
        "tiny-1p1d", name=name, snic_mbit=snic_mbit, subnet=_free_subnet()
    )


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cluster.RUN_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def state(run_dir: Path) -> Iterator[ClusterState]:
    name = _name()
    try:
        yield cluster.up(_spec(name, snic_mbit=40))
    finally:
        cluster.down(name)


def _ping(state: ClusterState, node: str | None, addr: str) -> int:
    argv = [PY, "-c", PING, addr]
    return subprocess.run(cluster.node_argv(state, node, argv) if node else argv).returncode


def _left(name: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    return [
        line
        for line in (ns + links).splitlines()
        if line.startswith((f"dp-{name}-", f"dp{name}c", f"dp{name}s", f"dp{name}-"))
    ] + [str(p) for p in Path("/dev/shm").glob(f"dp{name}-*")]


def test_spec_layout_and_json_round_trip() -> None:
    spec = ClusterSpec.from_preset("tiny-1p1d", name="ab1", subnet="10.150")
    assert [n.name for n in spec.nodes] == ["p0", "d0", "store"]
    assert [n.namespace for n in spec.nodes] == ["dp-ab1-p0", "dp-ab1-d0", "dp-ab1-store"]
    assert spec.address("p0", "cnic") == "10.150.1.10"
    assert spec.address("d0", "snic") == "10.150.2.20"
    assert spec.address("store", "snic") == "10.150.2.254"
    with pytest.raises(ValueError, match="store"):
        spec.address("store", "cnic")
    # tiny-1p1d: SNIC 100 MB/s, CNIC 2 × 2 GB/s per node → 2 MB/s and 80 MB/s at 16 Mbit/s
    assert spec.rate_bytes_per_s("p0", "snic") == pytest.approx(2e6)
    assert spec.rate_bytes_per_s("p0", "cnic") == pytest.approx(80e6)
    assert spec.rate_bytes_per_s("store", "snic") == 0
    capped = ClusterSpec.from_preset("tiny-1p1d", name="ab1", snic_mbit=100, cnic_cap_mbit=500)
    assert capped.rate_bytes_per_s("d0", "cnic") == pytest.approx(500e6 / 8)
    assert ClusterSpec.from_preset(name="dp") == ClusterSpec.from_preset(name="dp")  # deterministic
    st = ClusterState(spec, 12.5)
    assert ClusterState.from_json(st.to_json()) == st
    links = [
        cmd[i + 1]
        for cmd in cluster.plan(spec)
        for i, word in enumerate(cmd[:-1])
        if word in ("dev", "name") or cmd[i - 1 : i + 1] == ["link", "add"]
    ]
    assert links and all(len(link) <= 15 for link in links)  # the kernel's IFNAMSIZ
    # no slow start after idle in any node (a datacenter host's setting)
    assert sum("net.ipv4.tcp_slow_start_after_idle=0" in cmd for cmd in cluster.plan(spec)) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "Bad!"}, "name"),
        ({"name": "toolong1"}, "name"),
        ({"preset": "nope"}, "preset"),
        ({"subnet": "8.8"}, "subnet"),
        ({"snic_mbit": 0}, "snic_mbit"),
    ],
)
def test_spec_refuses_bad_input(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ClusterSpec.from_preset(**kwargs)  # type: ignore[arg-type]


@needs_ns
def test_up_status_down(run_dir: Path) -> None:
    name = _name()
    try:
        state = cluster.up(_spec(name))
        assert state == ClusterState.load(name)
        with pytest.raises(cluster.ClusterError, match=f"cluster down --name {name}"):
            cluster.up(state.spec)
        info = cluster.status(name)
        assert [(n["node"], n["kind"], n["up"]) for n in info["nodes"]] == [
            ("p0", "prefill", True),
            ("d0", "decode", True),
            ("store", "store", True),
        ]
        assert info["nodes"][0]["snic"]["rate_bytes_per_s"] == pytest.approx(2e6)
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert f"dp{name}c " in links and f"dp{name}s " in links
        for node in ("p0", "d0"):  # the head reaches every node on both networks
            assert _ping(state, None, state.address(node, "cnic")) == 0
            assert _ping(state, None, state.address(node, "snic")) == 0
        assert _ping(state, "p0", state.address("d0", "cnic")) == 0  # node → node over CNIC
        assert _ping(state, "d0", state.address("store", "snic")) == 0  # node → store over SNIC
        assert _ping(state, "store", state.address("p0", "cnic")) != 0  # the store has no CNIC
        Path(f"/dev/shm/dp{name}-seg").write_bytes(b"kv")
        sleeper = cluster.popen(state, "d0", ["sleep", "60"])
        removed = cluster.down(name)
        assert sleeper.wait(timeout=5) != 0
        assert f"netns dp-{name}-p0" in removed and f"file /dev/shm/dp{name}-seg" in removed
        assert _left(name) == [] and not cluster.state_path(name).exists()
        assert cluster.down(name) == []  # twice is fine
        # a crashed run: the cluster up, its state file gone; down still cleans
        cluster.up(_spec(name))
        cluster.state_path(name).unlink()
        assert f"netns dp-{name}-store" in cluster.down(name)
        assert _left(name) == []
    finally:
        cluster.down(name)
    assert _left(name) == []


def _send(state: ClusterState, src: str, dst: str, num_bytes: int, port: int) -> float:
    """Send ``num_bytes`` over TCP from node ``src`` to node ``dst``'s SNIC; the goodput, B/s."""
    addr = state.address(dst, "snic")
    sink = cluster.popen(
        state, dst, [PY, "-c", SINK, addr, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        argv = [PY, "-c", SOURCE, addr, str(port), str(num_bytes)]
        out = subprocess.run(
            cluster.node_argv(state, src, argv), capture_output=True, text=True, timeout=10
        )
        assert out.returncode == 0, out.stderr
        assert int(sink.stdout.readline()) == num_bytes
    finally:
        sink.kill()
        sink.wait()
    return num_bytes / float(out.stdout)


def _snic_tx_bytes(state: ClusterState, node: str) -> int:
    nodes = cluster.status(state.spec.name)["nodes"]
    return int(next(n for n in nodes if n["node"] == node)["snic"]["tx_bytes"])


@needs_ns
def test_snic_rate_is_enforced_both_ways(state: ClusterState) -> None:
    rate = state.spec.rate_bytes_per_s("p0", "snic")
    assert rate == pytest.approx(5e6)  # 40 Mbit/s
    num_bytes = 2_500_000
    before = _snic_tx_bytes(state, "p0")
    up_bps = _send(state, "p0", "store", num_bytes, 7000)  # node side's tbf: node → network
    assert _snic_tx_bytes(state, "p0") - before >= num_bytes
    down_bps = _send(state, "store", "p0", num_bytes, 7001)  # bridge side's tbf: network → node
    for goodput in (up_bps, down_bps):
        assert 0.6 * rate <= goodput <= 1.1 * rate, f"{goodput / 1e6:.2f} MB/s at {rate / 1e6} MB/s"


@needs_ns
def test_cli_exec_passes_exit_code(state: ClusterState, capsys: pytest.CaptureFixture[str]) -> None:
    name = state.spec.name
    assert main(["cluster", "exec", "d0", "--name", name, "--", "sh", "-c", "exit 7"]) == 7
    assert main(["cluster", "exec", "store", "--name", name, "--", "true"]) == 0
    assert main(["cluster", "status", "--name", name, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["nodes"][2]["snic"]["addr"] == state.address("store", "snic")
    assert main(["cluster", "exec", "x9", "--name", name, "--", "true"]) == 2
    assert "node='x9'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["cluster", "up", "--preset", "nope"], "preset='nope'"),
        (["cluster", "up", "--name", "Bad"], "name='Bad'"),
        (["cluster", "down", "--name", "toolong1"], "name='toolong1'"),
        (["cluster", "up", "--subnet", "1.2.3.4/8"], "subnet='1.2.3.4/8'"),
    ],
)
def test_cli_refuses_bad_input(
    argv: list[str], says: str, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and (says in err or err == f"dualpath: error: {REASON}")
