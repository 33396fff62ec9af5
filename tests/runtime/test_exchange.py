"""The per-layer hidden-state all-gather between the PEs of a group (real bytes: shared memory
on one host, the collectives' own marked TCP transport across nodes)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dualpath.kv.transport import make_collective_transport  # noqa: E402
from dualpath.kv.transport.shm import ShmTransport  # noqa: E402
from dualpath.runtime.exchange import SLOT_BYTES, HiddenExchange, region_bytes  # noqa: E402
from dualpath.runtime.messages import ExchangePlan  # noqa: E402

HIDDEN = 256


@pytest.fixture(params=["shm", "tcp"])
def group(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[list[HiddenExchange], list[Any], list[list[tuple[int, int]]]]]:
    """Two PEs (engines 0 and 1) with their own transports and exchange segments; over
    ``tcp`` each has the collectives' transport that the PE engine makes across nodes."""
    segs = [SharedMemory(create=True, size=region_bytes(2)) for _ in range(2)]
    made = [make_collective_transport(request.param) for _ in range(2)]
    transports = [t or ShmTransport() for t in made]
    charges: list[list[tuple[int, int]]] = [[], []]
    xs, handles = [], []
    for e in range(2):
        assert segs[e].buf is not None
        handle = transports[e].register(segs[e].name, segs[e].buf)
        handles.append(handle)

        def charge(peer: int, n: int, e: int = e) -> None:
            charges[e].append((peer, n))

        xs.append(HiddenExchange(e, transports[e], handle, segs[e].buf, (0, 1), charge, 5.0))
    yield xs, handles, charges
    for x in xs:
        x.close()
    for t in transports:
        t.close()
    for s in segs:
        s.close()
        s.unlink()


def _both(fns: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None, None]
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as err:
            errs.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errs:
        raise errs[0]
    return out


def test_all_gather_delivers_every_peer_states_each_layer_in_several_rounds(group: Any) -> None:
    xs, handles, charges = group
    big = SLOT_BYTES // (HIDDEN * 4) + 7  # more than one slot: two rounds per layer
    tokens = (big, 5)
    plan = ExchangePlan(1, (0, 1), tuple(handles), (os.getpid(),) * 2, tokens)
    gen = torch.Generator().manual_seed(0)
    states = [[torch.randn(n, HIDDEN, generator=gen) for n in tokens] for _ in range(3)]
    steps = [x.run_pass(plan, HIDDEN) for x in xs]
    for layer in range(3):  # consecutive layers reuse the slots by parity, never unread
        got = _both([lambda e=e, n=layer: steps[e](n, states[n][e]) for e in range(2)])
        assert torch.equal(got[0][0], states[layer][1])  # PE 0 received PE 1's states
        assert torch.equal(got[1][0], states[layer][0])
    # each send charged once per peer with its real bytes (on tx and the peer's rx)
    assert sum(n for _, n in charges[0]) == 3 * big * HIDDEN * 4
    assert sum(n for _, n in charges[1]) == 3 * 5 * HIDDEN * 4
    assert {p for p, _ in charges[0]} == {1}
    assert xs[1].stats.bytes_received == 3 * big * HIDDEN * 4
    conns = [c for x in xs for c in getattr(x.transport, "_conns", [])]
    for conn in conns:  # across nodes, every collective packet carries the high-class DSCP
        assert conn.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 26 << 2
    assert bool(conns) == (handles[0].endpoint.startswith("tcp://"))


def test_a_dead_peer_is_dropped_instead_of_blocking_the_pass(group: Any) -> None:
    xs, handles, _ = group
    dead = 2**22 + 12345  # beyond pid_max on this host: no such process
    assert not os.path.exists(f"/proc/{dead}")
    plan = ExchangePlan(2, (0, 1), tuple(handles), (os.getpid(), dead), (4, 4))
    step = xs[0].run_pass(plan, HIDDEN)
    assert step(0, torch.ones(4, HIDDEN)) == []  # nothing from the dead peer, no hang
    assert xs[0].stats.peers_lost == 1


def test_wrong_sized_states_are_an_error(group: Any) -> None:
    xs, handles, _ = group
    plan = ExchangePlan(3, (0, 1), tuple(handles), (os.getpid(),) * 2, (4, 4))
    with pytest.raises(ValueError, match="plan says 4 tokens"):
        xs[0].run_pass(plan, HIDDEN)(0, torch.ones(3, HIDDEN))
    with pytest.raises(ValueError, match="as many regions"):
        ExchangePlan(4, (0, 1), tuple(handles), (1,), (4, 4))
