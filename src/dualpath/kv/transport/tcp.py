"""Plain TCP backend: one-sided reads/writes of registered regions, served by their owner.

Each process listens on ``host`` (``DUALPATH_KV_HOST``, default loopback) and serves reads and
writes of its own registered regions by name; transfers to peers run on a small thread pool,
each thread keeping one connection per peer. It is the portable fallback where Mooncake's
Transfer Engine is not installed (Mooncake uses RDMA where the NICs have it). Unauthenticated,
like Mooncake's TCP transport: bind it only to a trusted cluster network.

Wire format: a request ``op, len(name), offset, nbytes`` (``!cHQQ``) plus the region name;
``W`` carries the payload after it, ``R`` gets it back after the status byte (0 = ok;
otherwise a 2-byte length and the error text).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

from dualpath.kv.transport.base import (
    FutureTransfer,
    KVTransport,
    RegionHandle,
    Transfer,
    check_range,
)

_HEADER = struct.Struct("!cHQQ")
_ERR_LEN = struct.Struct("!H")
PREFIX = "tcp://"


class TransportError(RuntimeError):
    """A transfer the peer refused or a connection that broke."""


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix(PREFIX).rsplit(":", 1)
    return host, int(port)


class TcpTransport(KVTransport):
    """Regions are served by name from this process's listener at ``endpoint``."""

    def __init__(self, host: str = "127.0.0.1", num_threads: int = 4, dscp: int = -1) -> None:
        """``dscp`` (0..63; -1: unmarked) marks every KV packet, both directions, so switches
        and NICs classify it into the traffic manager's low lane (``dualpath qos``)."""
        if not -1 <= dscp <= 63:
            raise ValueError(f"dscp={dscp} is invalid: must be in 0..63 (or -1: unmarked)")
        self._dscp = dscp
        self._local: dict[str, memoryview] = {}
        self._server = socket.create_server((host, 0))
        self.endpoint = f"{PREFIX}{host}:{self._server.getsockname()[1]}"
        self._closing = threading.Event()
        self._conns: list[socket.socket] = []  # every socket this transport opened or accepted
        self._servers: list[threading.Thread] = []  # one per accepted connection
        self._conns_lock = threading.Lock()
        self._tls = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tcp-kv")
        threading.Thread(target=self._accept, name="tcp-kv-accept", daemon=True).start()

    # ------------------------------------------------------------------ server side
    def _track(self, sock: socket.socket) -> socket.socket:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._dscp >= 0:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self._dscp << 2)
        with self._conns_lock:
            self._conns.append(sock)
        return sock

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # listener closed
            self._track(conn)
            server = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._conns_lock:
                self._servers.append(server)
            server.start()

    def _region(self, name: str, offset: int, nbytes: int) -> memoryview:
        memory = self._local.get(name)
        if memory is None:
            raise ValueError(f"region {name!r} is not registered at {self.endpoint}")
        check_range(RegionHandle(self.endpoint, name, 0, len(memory)), offset, nbytes)
        return memory[offset : offset + nbytes]

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                op, name_len, offset, nbytes = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                name = _recv_exact(conn, name_len).decode()
                try:
                    view = self._region(name, offset, nbytes)
                except ValueError as err:
                    if op == b"W":  # consume the payload so the stream stays in step
                        _recv_exact(conn, nbytes)
                    text = str(err).encode()[:65535]
                    conn.sendall(b"\x01" + _ERR_LEN.pack(len(text)) + text)
                    continue
                if op == b"W":
                    _recv_into(conn, view)
                    conn.sendall(b"\x00")
                else:
                    conn.sendall(b"\x00")
                    conn.sendall(view)
                # drop the view before waiting: a region's owner can only unmap its memory
                # (close a shared-memory segment) once no view of it is left
                del view
        except (OSError, ConnectionError, struct.error):
            conn.close()  # peer gone or transport closing

    # ------------------------------------------------------------------ client side
    def _conn(self, endpoint: str) -> socket.socket:
        conns: dict[str, socket.socket] | None = getattr(self._tls, "conns", None)
        if conns is None:
            conns = self._tls.conns = {}
        sock = conns.get(endpoint)
        if sock is None:
            sock = self._track(socket.create_connection(_split(endpoint), timeout=60.0))
            conns[endpoint] = sock
        return sock

    def _status(self, sock: socket.socket, peer: RegionHandle) -> None:
        if _recv_exact(sock, 1) != b"\x00":
            (n,) = _ERR_LEN.unpack(_recv_exact(sock, _ERR_LEN.size))
            raise TransportError(f"{peer.endpoint}: {_recv_exact(sock, n).decode()}")

    def _request(self, op: bytes, peer: RegionHandle, offset: int, local: memoryview) -> None:
        if peer.endpoint == self.endpoint:  # our own region: a copy
            remote = self._region(peer.name, offset, len(local))
            if op == b"W":
                remote[:] = local
            else:
                local[:] = remote
            return
        sock = self._conn(peer.endpoint)
        name = peer.name.encode()
        try:
            sock.sendall(_HEADER.pack(op, len(name), offset, len(local)) + name)
            if op == b"W":
                sock.sendall(local)
                self._status(sock, peer)
            else:
                self._status(sock, peer)
                _recv_into(sock, local)
        except (OSError, ConnectionError) as err:
            self._tls.conns.pop(peer.endpoint, None)
            sock.close()
            raise TransportError(f"transfer with {peer.endpoint} failed: {err}") from err

    def _local_view(self, handle: RegionHandle, offset: int, nbytes: int) -> memoryview:
        if handle.endpoint != self.endpoint:
            raise ValueError(f"region {handle.name!r} is not registered in this process")
        return self._region(handle.name, offset, nbytes)

    def register(self, name: str, memory: memoryview) -> RegionHandle:
        self._local[name] = memory.cast("B") if memory.format != "B" else memory
        return RegionHandle(self.endpoint, name, 0, len(memory))

    def write(
        self, src: RegionHandle, src_offset: int, dst: RegionHandle, dst_offset: int, nbytes: int
    ) -> Transfer:
        check_range(dst, dst_offset, nbytes)
        local = self._local_view(src, src_offset, nbytes)
        return FutureTransfer(self._pool.submit(self._request, b"W", dst, dst_offset, local))

    def read(
        self, dst: RegionHandle, dst_offset: int, src: RegionHandle, src_offset: int, nbytes: int
    ) -> Transfer:
        check_range(src, src_offset, nbytes)
        local = self._local_view(dst, dst_offset, nbytes)
        return FutureTransfer(self._pool.submit(self._request, b"R", src, src_offset, local))

    def close(self) -> None:
        self._closing.set()
        self._pool.shutdown(wait=True)
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._server.close()
        with self._conns_lock:
            for sock in self._conns:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._conns.clear()
            servers, self._servers = self._servers, []
        for server in servers:  # each lets go of its region views as its socket closes
            server.join(timeout=1.0)
        self._local.clear()
