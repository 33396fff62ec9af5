"""A networked node's compute network (CNIC): its transfer engine, the peers' buffers, pushes.

The side-car of a node of a cluster owns one ``ComputeNic``. It moves KV from its own buffer
into another node's over the compute network (Mooncake Transfer Engine: TCP here, RDMA on
clusters), one-sided, never through the router:

- ``push``: whole slots, answered once every byte landed (the DE read path's hits before a
  prefill, the PE read path's hits while it runs, a fallback after it);
- ``push_layer`` / ``handed``: the layerwise hand-over (arXiv 2602.21548 §4, layerwise
  prefill on the PE → DE hop). Each worker of the prefill instance reports each layer it
  saved into its node's buffer (its part: a tensor-parallel rank writes only its heads); once
  every writer of the layer reported, the layer's bytes of those slots are submitted to the
  DE node's slots at once, while the next layers compute. After the prefill answered, the
  router's ``handed`` closes the job: later reports of it are dropped, every transfer
  submitted is waited for, and the answer names the slots not wholly there (a layer whose
  parts did not all arrive, a failed transfer), which the router pushes whole. A request given
  up on is closed the same way before its DE slots go back, so that no transfer of it can
  land in a slot someone else holds by then.

Owns no policy and no slot: the router allocated both sides' slots under its lease.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dualpath.integrations.vllm.node import call
from dualpath.kv.buffer import SlotBuffer
from dualpath.kv.store import BlockLayout
from dualpath.kv.transport.base import KVTransport, RegionHandle, Transfer

# a closed hand-over's name is remembered this long, so that a worker's report that comes
# after its router closed it is dropped, not taken for a new job (a step runs far shorter)
CLOSED_KEEP_S = 600.0
# a hand-over whose router never closed it (the router died) is dropped after this
OPEN_KEEP_S = 600.0


@dataclass(slots=True)
class _Forward:
    """One layerwise hand-over while its layers are pushed."""

    since: float
    moves: list[Transfer] = field(default_factory=list)
    layers: dict[int, set[int]] = field(default_factory=dict)  # source slot → layers submitted
    parts: dict[tuple[Any, ...], set[str]] = field(default_factory=dict)  # a layer's reports
    failed: bool = False


class ComputeNic:
    """Node buffer ``buffer`` (of Full Blocks ``layout``) as registered with ``engine`` under
    ``name``; pushes into the buffers of the side-cars at other control addresses."""

    def __init__(
        self, engine: KVTransport, buffer: SlotBuffer, layout: BlockLayout, name: str
    ) -> None:
        self.engine = engine
        self.buffer = buffer
        self.layout = layout
        self.region = engine.register(name, buffer.data)
        self._peers: dict[str, RegionHandle] = {}  # control address → its registered buffer
        self._lock = threading.Lock()
        self._forwards: dict[str, _Forward] = {}
        self._closed: dict[str, float] = {}  # hand-overs closed, and when
        self.bytes_pushed = 0
        self.push_busy_s = 0.0
        self.bytes_forwarded = 0  # of bytes_pushed: layer by layer during a prefill
        self.slots_pushed_after = 0  # slots a hand-over left for a whole push after it
        self.reports_dropped = 0  # layer reports of hand-overs already closed

    def describe(self) -> dict[str, Any]:
        r = self.region
        return {
            "endpoint": r.endpoint,
            "name": r.name,
            "address": r.address,
            "size_bytes": r.size_bytes,
        }

    def _peer(self, address: str, fresh: bool = False) -> RegionHandle:
        if fresh or address not in self._peers:
            self._peers[address] = RegionHandle(**call(address, {"op": "region"}, 10.0))
        return self._peers[address]

    # ---------------------------------------------------------------- whole slots
    def push(self, slots: list[int], to: str, to_slots: list[int]) -> int:
        """Write ``slots`` into the slots ``to_slots`` of the node whose side-car is at ``to``
        (its buffer as its transfer engine registered it); bytes moved."""
        if len(slots) != len(to_slots):
            raise ValueError(f"push: {len(slots)} slots for {len(to_slots)} peer slots")
        stride, nbytes = self.buffer.spec.stride_bytes, self.layout.full_block_bytes
        runs = _runs(slots, to_slots)
        start = time.perf_counter()
        for attempt in (0, 1):  # a peer restarted since: its buffer registered anew
            peer = self._peer(to, fresh=attempt > 0)
            try:
                moves = [
                    self.engine.write(
                        self.region, s * stride, peer, d * stride, (k - 1) * stride + nbytes
                    )
                    for s, d, k in runs
                ]
                for move in moves:
                    move.wait()
                break
            except (RuntimeError, ValueError):
                if attempt:
                    raise
        moved = len(slots) * nbytes
        with self._lock:
            self.bytes_pushed += moved
            self.push_busy_s += time.perf_counter() - start
        return moved

    # ---------------------------------------------------------------- layer by layer
    def push_layer(self, layer: int, part: str, parts: int, jobs: list[dict[str, Any]]) -> int:
        """Worker ``part`` (of ``parts`` writers of this layer) saved layer ``layer`` of each
        of ``jobs`` (``job``, ``slots``, ``to``: a side-car's address, ``to_slots``); the
        layer's bytes of every job all of whose writers reported are submitted. How many
        were (a closed job's report is dropped)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(
                f"push_layer: layer={layer} is invalid: a Full Block has "
                f"{self.layout.num_layers} layers"
            )
        submitted = 0
        now = time.monotonic()
        with self._lock:  # (a submit under the lock: ``handed`` sees every transfer)
            self._expire(now)
            for j in jobs:
                name, slots, to_slots = str(j["job"]), list(j["slots"]), list(j["to_slots"])
                if len(slots) != len(to_slots):
                    raise ValueError(
                        f"push_layer: {len(slots)} slots for {len(to_slots)} peer slots"
                    )
                if name in self._closed:
                    self.reports_dropped += 1
                    continue
                fw = self._forwards.setdefault(name, _Forward(now))
                key = (layer, tuple(slots), tuple(to_slots), str(j["to"]))
                seen = fw.parts.setdefault(key, set())
                seen.add(part)
                if len(seen) < parts:
                    continue
                del fw.parts[key]
                if fw.failed:
                    continue
                try:
                    fw.moves.append(self._submit_layer(layer, slots, str(j["to"]), to_slots))
                except (OSError, RuntimeError, ValueError):
                    fw.failed = True  # the router pushes the job's slots whole
                    continue
                for s in slots:
                    fw.layers.setdefault(s, set()).add(layer)
                self.bytes_forwarded += len(slots) * self.layout.layer_block_bytes
                self.bytes_pushed += len(slots) * self.layout.layer_block_bytes
                submitted += 1
        return submitted

    def _submit_layer(self, layer: int, slots: list[int], to: str, to_slots: list[int]) -> Transfer:
        stride, size = self.buffer.spec.stride_bytes, self.layout.layer_block_bytes
        at = self.layout.layer_offset(layer)
        pairs = zip(slots, to_slots, strict=True)
        ranges = [(s * stride + at, d * stride + at, size) for s, d in pairs]
        return self.engine.write_many(self.region, self._peer(to), ranges)

    def handed(self, job: str, slots: list[int]) -> list[int]:
        """Close hand-over ``job`` (later reports of it are dropped) and wait for every
        transfer it submitted; the indices into ``slots`` of those not wholly pushed (every
        layer of the Full Block landed), for the router to push whole."""
        now = time.monotonic()
        with self._lock:
            self._closed[job] = now
            fw = self._forwards.pop(job, None)
        failed = fw is None or fw.failed
        if fw is not None:
            for move in fw.moves:
                try:
                    move.wait()
                except (RuntimeError, ValueError):
                    failed = True
        every = set(range(self.layout.num_layers))
        layers = fw.layers if fw is not None else {}
        missing = [i for i, s in enumerate(slots) if failed or layers.get(s) != every]
        with self._lock:
            self.slots_pushed_after += len(missing)
        return missing

    def _expire(self, now: float) -> None:
        """(Under the lock.) Names closed long ago, hand-overs no router closed."""
        for name in [n for n, t in self._closed.items() if now - t > CLOSED_KEEP_S]:
            del self._closed[name]
        for name in [n for n, f in self._forwards.items() if now - f.since > OPEN_KEEP_S]:
            del self._forwards[name]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_pushed": self.bytes_pushed,
                "push_busy_s": self.push_busy_s,
                "bytes_forwarded": self.bytes_forwarded,
                "slots_pushed_after": self.slots_pushed_after,
                "forward_reports_dropped": self.reports_dropped,
                "forwards_open": len(self._forwards),
            }

    def close(self) -> None:
        self.engine.close()


def _runs(slots: list[int], to_slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first peer slot, count) of each run consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(slots, to_slots, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
