"""The PEs of an EP group exchange their hidden states every layer (design §6, §13.8).

An all-gather through the KV transport: after computing a layer, each PE writes its new
tokens' hidden states (float32) into every peer's exchange region, charged as HIGH on its
CNIC tx and on the peer's CNIC rx, then waits until every peer's states for that layer have
arrived in its own region (the group runs each layer in lockstep, as a collective does).

Each PE owns one region (a shared-memory segment the launcher creates): a slot per (sender,
parity), each a 32-byte header ``(seq, nbytes, crc32, seq)`` then ``SLOT_BYTES`` of payload.
A layer's payload larger than a slot goes in several rounds; every member runs the same
number of rounds (the pass tells each PE every member's token count). Round ``k`` uses
parity ``k % 2``: a sender reaches round ``k + 2`` only after every peer sent round ``k + 1``,
which each does only after reading round ``k``, so a slot is never overwritten unread.
The header goes after the payload, as a separate transfer; a receiver accepts a slot whose
header carries the expected sequence number and whose payload matches the crc32.

The dense runtime model needs nothing from its peers (it stands in for the MoE dispatch /
combine or the TP all-gather of a bigger model), so the received states are verified, not
used. A peer that dies mid-pass (its pid gone or a zombie) is dropped from the rest of the
pass; the scheduler re-queues its requests. A pid of 0 is a peer on another host (Ray), whose
liveness this host cannot see: its death costs the receive timeout instead.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dualpath.kv.transport.base import KVTransport, RegionHandle
from dualpath.runtime.messages import ExchangePlan

if TYPE_CHECKING:
    import torch

HEADER_BYTES = 32
SLOT_BYTES = 1 << 22  # payload per slot: 4 MiB (4096 tokens of a 256-wide float32 state)
POLL_S = (5e-5, 2e-3)  # receive polling backs off from 50 µs to 2 ms (2 cores, no spin)
_HEADER = struct.Struct("<qqqq")


def region_bytes(group_size: int) -> int:
    """Size of one PE's exchange region for an EP group of ``group_size`` PEs."""
    return group_size * 2 * (HEADER_BYTES + SLOT_BYTES)


def slot_offset(sender_index: int, parity: int) -> int:
    return (sender_index * 2 + parity) * (HEADER_BYTES + SLOT_BYTES)


def is_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _may_live(pid: int) -> bool:
    """False only for a peer known dead: pid 0 (on another host) may always live."""
    return pid <= 0 or is_alive(pid)


@dataclass(slots=True)
class ExchangeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    layers: int = 0
    peers_lost: int = 0


class HiddenExchange:
    """One PE's side of the per-layer all-gather. ``charge(peer, nbytes)`` paces a send (on
    this PE's tx and the peer's rx); ``local`` is this PE's own region (its memory)."""

    def __init__(
        self,
        engine_id: int,
        transport: KVTransport,
        local: RegionHandle,
        local_memory: memoryview,
        group: Sequence[int],
        charge: Callable[[int, int], None],
        timeout_s: float,
        orphaned: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine_id = engine_id
        self.transport = transport
        self.local = local
        self.group = tuple(group)  # every PE of the group, in order: fixes the slot indices
        self._mem = np.frombuffer(local_memory, dtype=np.uint8)
        self._charge = charge
        self._timeout_s = timeout_s
        self._orphaned = orphaned  # the run is gone (parent died): stop waiting
        self._staging_bytes = bytearray(HEADER_BYTES + SLOT_BYTES)
        self._staging = np.frombuffer(self._staging_bytes, dtype=np.uint8)
        self._staging_handle = transport.register(
            f"xstage{engine_id}-{os.getpid()}", memoryview(self._staging_bytes)
        )
        self.stats = ExchangeStats()

    def run_pass(
        self, plan: ExchangePlan, hidden_size: int
    ) -> Callable[[int, torch.Tensor], list[torch.Tensor]]:
        """A per-layer function for one pass: ``(layer, my hidden states) → peers' states``
        (one ``[tokens, hidden]`` tensor per other participant, in plan order)."""
        me = plan.engines.index(self.engine_id)
        row = hidden_size * 4
        most = max(plan.new_tokens) * row
        rounds = max(1, -(-most // SLOT_BYTES))
        lost: set[int] = set()
        state = {"k": 0}

        import torch

        def layer_step(layer: int, h: torch.Tensor) -> list[torch.Tensor]:
            mine = h.detach().contiguous().numpy().view(np.uint8).reshape(-1)
            if mine.size != plan.new_tokens[me] * row:
                raise ValueError(
                    f"exchange: PE {self.engine_id} has {mine.size} bytes for layer {layer}, "
                    f"plan says {plan.new_tokens[me]} tokens"
                )
            got = {j: bytearray() for j in range(len(plan.engines)) if j != me}
            for r in range(rounds):
                k = state["k"]
                state["k"] += 1
                seq = plan.pass_id * (1 << 24) + k + 1
                piece = mine[r * SLOT_BYTES : (r + 1) * SLOT_BYTES]
                self._send(plan, me, piece, seq, k % 2, lost)
                for j, buf in got.items():
                    if j not in lost:
                        data = self._receive(plan, j, seq, k % 2, lost)
                        if data is not None:
                            buf += data
            self.stats.layers += 1
            out = []
            for j, buf in got.items():
                if j in lost:
                    continue
                if len(buf) != plan.new_tokens[j] * row:
                    raise RuntimeError(
                        f"exchange: layer {layer} from PE {plan.engines[j]}: {len(buf)} bytes, "
                        f"expected {plan.new_tokens[j] * row}"
                    )
                out.append(torch.frombuffer(buf, dtype=torch.float32).view(-1, hidden_size))
            return out

        return layer_step

    def _send(
        self, plan: ExchangePlan, me: int, piece: np.ndarray, seq: int, parity: int, lost: set[int]
    ) -> None:
        n = piece.size
        src = self._staging
        src[HEADER_BYTES : HEADER_BYTES + n] = piece
        crc = zlib.crc32(memoryview(self._staging_bytes)[HEADER_BYTES : HEADER_BYTES + n])
        src[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(seq, n, crc, seq), dtype=np.uint8)
        base = slot_offset(self.group.index(self.engine_id), parity)
        for j, peer in enumerate(plan.engines):
            if j == me or j in lost:
                continue
            self._charge(peer, n)
            try:
                region = plan.regions[j]
                if n:
                    stg = self._staging_handle
                    self.transport.write(stg, HEADER_BYTES, region, base + HEADER_BYTES, n).wait()
                self.transport.write(self._staging_handle, 0, region, base, HEADER_BYTES).wait()
                self.stats.bytes_sent += n
            except Exception:
                if _may_live(plan.pids[j]):
                    raise
                self._lose(j, lost)

    def _receive(
        self, plan: ExchangePlan, j: int, seq: int, parity: int, lost: set[int]
    ) -> bytes | None:
        base = slot_offset(self.group.index(plan.engines[j]), parity)
        mem = self._mem
        deadline = time.monotonic() + self._timeout_s
        checks, poll_s = 0, POLL_S[0]
        while True:
            s1, n, crc, s2 = _HEADER.unpack(mem[base : base + HEADER_BYTES].tobytes())
            if s1 == seq == s2 and 0 <= n <= SLOT_BYTES:
                data = mem[base + HEADER_BYTES : base + HEADER_BYTES + n].tobytes()
                if zlib.crc32(data) == crc:
                    self.stats.bytes_received += n
                    return data
            checks += 1
            if checks % 20 == 0 and not _may_live(plan.pids[j]):
                self._lose(j, lost)
                return None
            if checks % 20 == 0 and self._orphaned():
                raise RuntimeError("exchange: the scheduler is gone")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"exchange: no valid hidden states from PE {plan.engines[j]} "
                    f"(seq {seq}) within {self._timeout_s:g} s"
                )
            time.sleep(poll_s)
            poll_s = min(POLL_S[1], poll_s * 2)

    def close(self) -> None:
        """Release this object's view of the region (so its owner can unmap it)."""
        self._mem = np.zeros(0, dtype=np.uint8)

    def _lose(self, j: int, lost: set[int]) -> None:
        lost.add(j)
        self.stats.peers_lost += 1
