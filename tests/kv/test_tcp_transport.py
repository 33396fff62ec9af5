"""TCP transport: one-sided reads and writes land where addressed, over real loopback sockets."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import socket
from typing import Any

import pytest

from dualpath.kv.transport import KV_DSCP_ENV, KV_HOST_ENV, make_transport
from dualpath.kv.transport.base import RegionHandle
from dualpath.kv.transport.mooncake import listening_sockets, non_loopback
from dualpath.kv.transport.tcp import TcpTransport, TransportError

pytestmark = pytest.mark.timeout(60)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(n))


def test_write_read_between_two_endpoints_and_errors() -> None:
    # this process's listeners from before (an in-process Mooncake engine of an earlier test
    # binds every interface: a library limitation, docs/runtime.md) are not the transport's
    before = set(listening_sockets())
    owner, peer = TcpTransport(), TcpTransport()
    try:
        buf = mmap.mmap(-1, 1 << 20)
        remote = owner.register("de-buffer", memoryview(buf))
        assert remote.endpoint.startswith("tcp://127.0.0.1:")
        hbm = memoryview(bytearray(_pattern(400_000, 3)))
        local = peer.register("hbm", hbm)
        writes = [
            peer.write(local, i * 100_000, remote, 7 + i * 100_000, 100_000) for i in range(4)
        ]
        for t in writes:
            t.wait()
            assert t.done()
        assert bytes(buf[7:400_007]) == bytes(hbm)  # four transfers in flight at once
        buf[900_000:900_300] = _pattern(300, 9)
        peer.read(local, 10, remote, 900_000, 300).wait()
        assert bytes(hbm[10:310]) == _pattern(300, 9)
        own = owner.register("own", memoryview(bytearray(64)))
        owner.write(own, 0, remote, 0, 64).wait()  # its own region: a local copy
        assert bytes(buf[:64]) == bytes(64)
        with pytest.raises(ValueError, match="invalid for region"):
            peer.write(local, 0, remote, (1 << 20) - 10, 100)
        ghost = RegionHandle(remote.endpoint, "nope", 0, 1 << 20)
        with pytest.raises(TransportError, match="'nope' is not registered"):
            peer.read(local, 0, ghost, 0, 100).wait()
        peer.read(local, 0, remote, 7, 5).wait()  # the connection is still in step after it
        assert bytes(hbm[:5]) == bytes(buf[7:12])
        with pytest.raises(ValueError, match="not registered in this process"):
            peer.write(remote, 0, local, 0, 8)
        assert not non_loopback(sorted(set(listening_sockets()) - before))  # loopback only
    finally:
        peer.close()
        owner.close()
    port = f"{int(remote.endpoint.rsplit(':', 1)[1]):04X}"
    assert all(a.rsplit(":", 1)[1] != port for _, a in listening_sockets())  # listener closed


def _owner(q: Any, done: Any) -> None:
    tx = make_transport("tcp")
    region = mmap.mmap(-1, 1 << 16)
    q.put(tx.register("buffer", memoryview(region)))
    want = done.get(timeout=30)
    q.put(bytes(region[: len(want)]) == want)
    tx.close()


def test_transfers_cross_processes_on_the_configured_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KV_HOST_ENV, "127.0.0.1")
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_owner, args=(q, done), daemon=True)
    proc.start()
    try:
        remote: RegionHandle = q.get(timeout=30)
        assert remote.endpoint.startswith("tcp://127.0.0.1:")
        tx = make_transport("tcp")
        data = _pattern(50_000, os.getpid() % 7)
        src = tx.register("hbm", memoryview(bytearray(data)))
        tx.write(src, 0, remote, 0, len(data)).wait()
        done.put(data)
        assert q.get(timeout=30) is True  # the owner sees the bytes written
        tx.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_dscp_marks_every_kv_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KV_DSCP_ENV, "16")  # the traffic manager's KV lane (CS2)
    owner, peer = make_transport("tcp"), make_transport("tcp")
    assert isinstance(owner, TcpTransport) and isinstance(peer, TcpTransport)
    try:
        remote = owner.register("buf", memoryview(bytearray(4096)))
        local = peer.register("hbm", memoryview(bytearray(4096)))
        peer.write(local, 0, remote, 0, 4096).wait()
        socks = peer._conns + owner._conns  # the client's and the accepted side
        assert len(socks) == 2
        assert {s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) for s in socks} == {16 << 2}
    finally:
        peer.close()
        owner.close()
    monkeypatch.setenv(KV_DSCP_ENV, "64")
    with pytest.raises(ValueError, match="DUALPATH_KV_DSCP='64' is invalid"):
        make_transport("tcp")
