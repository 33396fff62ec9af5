"""Probes of the traffic manager on real packets: a marked ping-pong and an unmarked bulk flow.

``python -m dualpath.deploy.qosprobe SERVER|pingpong|bulk ...`` runs one end; the test of the
tc classes and ``benchmarks/bench_qos.py`` start them inside a cluster's namespaces.

- ``server --host H --port P --dscp D``: answers ping-pong connections (every message echoed,
  replies marked ``D``) and swallows bulk connections (a first byte ``b"B"`` or ``b"P"``).
- ``pingpong --to H:P --dscp D --size N --seconds S --interval-s I``: one message of ``N``
  bytes at a time, marked ``D``, waits for its echo; prints JSON: round trips in µs (p50, p99,
  max, count).
- ``bulk --to H:P --seconds S``: sends unmarked as fast as the link takes for ``S`` seconds;
  prints JSON: bytes sent and the rate.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

CHUNK = 1 << 16


def _mark(sock: socket.socket, dscp: int) -> None:
    if dscp >= 0:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def _serve_one(conn: socket.socket, dscp: int) -> None:
    with conn:
        kind = conn.recv(1)
        if kind == b"B":  # bulk: swallow
            buf = bytearray(CHUNK)
            while conn.recv_into(buf):
                pass
            return
        if kind != b"P":
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _mark(conn, dscp)
        head = bytearray(4)
        while _recv_exact(conn, memoryview(head)):
            size = int.from_bytes(head, "big")
            body = bytearray(size)
            if not _recv_exact(conn, memoryview(body)):
                return
            conn.sendall(head + body)


def serve(host: str, port: int, dscp: int) -> None:
    server = socket.create_server((host, port), reuse_port=False)
    print(json.dumps({"listening": f"{host}:{server.getsockname()[1]}"}), flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_one, args=(conn, dscp), daemon=True).start()


def _connect(to: str) -> socket.socket:
    host, port = to.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def pingpong(to: str, dscp: int, size: int, seconds: float, interval_s: float) -> dict:
    sock = _connect(to)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _mark(sock, dscp)
    sock.sendall(b"P")
    msg = size.to_bytes(4, "big") + bytes(size)
    back = bytearray(4 + size)
    rtts: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        sock.sendall(msg)
        if not _recv_exact(sock, memoryview(back)):
            raise ConnectionError("the echo server closed the connection")
        rtts.append((time.perf_counter() - t0) * 1e6)
        time.sleep(interval_s)
    sock.close()
    return {
        "p50_us": percentile(rtts, 50),
        "p99_us": percentile(rtts, 99),
        "max_us": max(rtts),
        "count": len(rtts),
    }


def bulk(to: str, seconds: float) -> dict:
    sock = _connect(to)
    sock.sendall(b"B")
    data = bytes(CHUNK)
    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sock.sendall(data)
        sent += CHUNK
    elapsed = time.monotonic() - t0
    sock.close()
    return {"bytes": sent, "mbit_per_s": sent * 8 / elapsed / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualpath.deploy.qosprobe")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--dscp", type=int, default=-1)
    pp = sub.add_parser("pingpong")
    pp.add_argument("--to", required=True)
    pp.add_argument("--dscp", type=int, default=-1)
    pp.add_argument("--size", type=int, default=4096)
    pp.add_argument("--seconds", type=float, default=3.0)
    pp.add_argument("--interval-s", type=float, default=0.002)
    b = sub.add_parser("bulk")
    b.add_argument("--to", required=True)
    b.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    if args.cmd == "server":
        serve(args.host, args.port, args.dscp)
    elif args.cmd == "pingpong":
        print(json.dumps(pingpong(args.to, args.dscp, args.size, args.seconds, args.interval_s)))
    else:
        print(json.dumps(bulk(args.to, args.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
