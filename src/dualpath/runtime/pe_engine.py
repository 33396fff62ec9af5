"""The PE process: batched, chunked, layerwise prefill over a paged HBM.

Each ``ForwardMsg`` is one forward pass packed by the policy's intra-engine plan: several
requests' chunks, computed together (``RuntimeModel.forward_batch``), layer by layer as
``layerwise.LayerwisePass`` loads them (storage hits from the PE or DE buffer, earlier chunks
from the DE buffer) and sends their new KV to the DE buffer; the PEs of the group exchange each
layer's hidden states (``exchange.HiddenExchange``). Then the first token of every finished
request is chosen.
"""

from __future__ import annotations

import os
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from dualpath.kv.pacer import transfer_all
from dualpath.kv.transport import make_collective_transport
from dualpath.kv.transport.base import KVTransport
from dualpath.metrics.hops import hop
from dualpath.runtime.engine import Engine
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.exchange import HiddenExchange, region_bytes
from dualpath.runtime.gputime import LayerFloor
from dualpath.runtime.layerwise import LayerwisePass
from dualpath.runtime.messages import ForwardDoneMsg, ForwardMsg
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.token_choice import choose_batch
from dualpath.types import TrafficClass


class PrefillEngine(Engine):
    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        super().__init__(env, engine_id, crash_at)
        self.exchange: HiddenExchange | None = None
        self._exchange_shm: SharedMemory | None = None
        self._collective: KVTransport | None = None
        name = env.exchange_names[engine_id] if env.exchange_names else ""
        group = env.group_members(engine_id)
        memory: memoryview | None = None
        if name:  # the launcher's segment, registered with the collectives' transport
            shm = SharedMemory(name=name)
            assert shm.buf is not None
            self._exchange_shm = shm
            memory = shm.buf
        elif env.own_exchange and len(group) > 1:  # its own region, announced when ready
            name = f"x{engine_id}-{os.getpid()}"
            memory = memoryview(bytearray(region_bytes(len(group))))
        if memory is not None:
            self._collective = make_collective_transport(env.options.transport)
            xport = self._collective or self.transport
            self.ready_region = xport.register(name, memory)
            self.exchange = HiddenExchange(
                engine_id,
                xport,
                self.ready_region,
                memory,
                group,
                self._charge_collective,
                env.options.request_timeout_s,
                lambda: not env.parent_alive(),
            )

    def _charge_collective(self, peer: int, nbytes: int) -> None:
        """HIGH on this CNIC's tx and the peer's rx (collectives are paced in every system)."""
        route = [self.cnic.tx, self.cnic_of(peer).rx]
        transfer_all(route, nbytes, TrafficClass.HIGH)

    def close(self) -> None:
        super().close()
        if self.exchange is not None:
            self.exchange.close()
        if self._collective is not None:
            self._collective.close()
        if self._exchange_shm is not None:
            self._exchange_shm.close()

    def handle(self, msg: Any) -> None:
        assert isinstance(msg, ForwardMsg)
        start = self.clock.now()
        hop("pe.pass", msg.chunks[0].request_id)
        chunks, pool = msg.chunks, self.pool
        work = LayerwisePass(self, msg)
        work.start()  # the loads begin while the group's exchange is set up
        plan = msg.exchange
        step = None
        if plan is not None and self.exchange is not None:
            step = self.exchange.run_pass(plan, self.model.hidden_size)
        floor = LayerFloor(self._emulated_s(msg), self.model.num_layers, self.clock.now)
        logits = work.compute(floor, step)
        hop("pe.layers_done", msg.chunks[0].request_id)
        last = [i for i, c in enumerate(chunks) if c.is_last]
        picked = choose_batch(
            [self.chooser(chunks[i].sampling) for i in last],
            logits[last] if len(last) < len(chunks) else logits,
            [_generator(chunks[i].sampling) for i in last],
        )
        firsts = tuple((chunks[i].request_id, t) for i, (t, _) in zip(last, picked, strict=True))
        logprobs = tuple(
            (chunks[i].request_id, lp)
            for i, (_, lp) in zip(last, picked, strict=True)
            if lp is not None
        )
        hop("pe.done", msg.chunks[0].request_id)
        self.env.results.put(
            ForwardDoneMsg(
                self.engine_id,
                tuple(c.request_id for c in chunks),
                firsts,
                start,
                self.clock.now(),
                work.moved_in,
                work.moved_out,
                pool.num_free,
                logprobs,
                floor.emulated_s or 0.0,
                floor.host_s,
            )
        )

    def _emulated_s(self, msg: ForwardMsg) -> float | None:
        """The pass's emulated GPU time (None: host time): this PE's chunks, its group's
        new tokens (the exchange plan's, else its own)."""
        if self.gpu_time is None:
            return None
        own = sum(c.new for c in msg.chunks)
        group = sum(msg.exchange.new_tokens) if msg.exchange is not None else own
        return self.gpu_time.prefill_s([(c.cached, c.new) for c in msg.chunks], group)


def _generator(sampling: SamplingParams | None) -> torch.Generator | None:
    """The generator of a request's first output token (None: greedy)."""
    if sampling is None or sampling.temperature <= 0.0:
        return None
    return sampling.generator(0)
