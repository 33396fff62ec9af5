"""What PE and DE processes share: the model, an emulated HBM region, the CNIC, the loop.

"HBM" is a registered local region laid out ``[layer][token][row]`` (capacity
``max_context_tokens``), so Layer Blocks land in it by transport and torch reads it in place.
Every byte into or out of the engine passes its CNIC pacer (``rx`` in, ``tx`` out).
"""

from __future__ import annotations

import mmap
import os
import queue
import signal
from typing import Any

import torch

from dualpath.runtime.buffer import PAGE_BYTES
from dualpath.runtime.env import ProcEnv, child_setup
from dualpath.runtime.messages import ErrorMsg, ReadyMsg, StopMsg
from dualpath.runtime.model import TinyTransformer
from dualpath.runtime.pacer import NicPacer
from dualpath.runtime.transport import make_transport
from dualpath.runtime.transport.base import RegionHandle
from dualpath.types import TrafficClass

POLL_S = 0.5


class Engine:
    """Base of PE and DE engine processes (one per emulated GPU)."""

    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        torch.set_num_threads(1)
        self.env = env
        self.engine_id = engine_id
        self.node = env.topology.node_of(engine_id)
        self.name = env.topology.engine_name(engine_id)
        self.clock = env.clock
        m = env.config.model
        self.model = TinyTransformer(m, seed=env.options.weight_seed)
        self.row_bytes = m.kv_bytes_per_token_per_layer
        self.capacity_tokens = m.max_context_tokens
        self.layer_bytes = self.capacity_tokens * self.row_bytes
        size = -(-m.num_layers * self.layer_bytes // PAGE_BYTES) * PAGE_BYTES
        self._hbm = mmap.mmap(-1, size)
        self.transport = make_transport(env.options.transport)
        self.hbm: RegionHandle = self.transport.register(f"hbm{engine_id}", memoryview(self._hbm))
        self.cnic = NicPacer.of(
            env.config.hardware.cnic_bytes_per_s, f"cnic{engine_id}", clock=self.clock.now
        )
        self.paced = env.options.paced_kv
        self.block_tokens = env.block_tokens
        self.layer_block_bytes = env.layout.layer_block_bytes
        self._crash_at = crash_at
        self._num_work = 0

    def hbm_offset(self, layer: int, token: int) -> int:
        return layer * self.layer_bytes + token * self.row_bytes

    def hbm_layer(self, layer: int, num_tokens: int) -> torch.Tensor:
        """Layer ``layer``'s KV of tokens ``0..num_tokens`` as a tensor view of HBM."""
        m = self.model
        count = num_tokens * self.row_bytes // 4
        flat = (
            torch.frombuffer(
                self._hbm, dtype=torch.float32, count=count, offset=self.hbm_offset(layer, 0)
            )
            if count
            else torch.zeros(0)
        )
        return flat.view(num_tokens, 2, m.num_kv_heads, m.head_dim)

    def pull(self, node: int, slot: int, layer: int, first: int, num_tokens: int, at: int) -> int:
        """Layer Block rows ``first..first+num_tokens`` of ``slot`` in node ``node``'s buffer →
        HBM tokens ``at..``; returns bytes moved (through the CNIC's receive side)."""
        nbytes = num_tokens * self.row_bytes
        if self.paced:
            self.cnic.rx.transfer(nbytes, TrafficClass.LOW)
        spec = self.env.buffers[node]
        src_off = slot * spec.stride_bytes + layer * self.layer_block_bytes + first * self.row_bytes
        self.transport.read(
            self.hbm, self.hbm_offset(layer, at), self.env.region(node), src_off, nbytes
        ).wait()
        return nbytes

    def push(self, node: int, slot: int, layer: int, first: int, num_tokens: int, at: int) -> int:
        """HBM tokens ``at..`` of ``layer`` → rows ``first..`` of ``slot`` (CNIC send side)."""
        nbytes = num_tokens * self.row_bytes
        if self.paced:
            self.cnic.tx.transfer(nbytes, TrafficClass.LOW)
        spec = self.env.buffers[node]
        dst_off = slot * spec.stride_bytes + layer * self.layer_block_bytes + first * self.row_bytes
        self.transport.write(
            self.hbm, self.hbm_offset(layer, at), self.env.region(node), dst_off, nbytes
        ).wait()
        return nbytes

    def handle(self, msg: Any) -> None:
        raise NotImplementedError

    def serve(self, inbox: Any) -> None:
        self.env.results.put(ReadyMsg(self.name, os.getpid()))
        while self.env.parent_alive():
            try:
                msg = inbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(msg, StopMsg):
                break
            self._num_work += 1
            if self._num_work == self._crash_at:  # fault injection: die or stall, mid-run
                if self.env.options.faults.crash_mode == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(17)
            self.handle(msg)
        self.close()

    def close(self) -> None:
        self.transport.close()


def engine_main(env: ProcEnv, engine_id: int, inbox: Any, crash_at: int) -> None:
    """Process entry point of engine ``engine_id`` (PE or DE by id)."""
    child_setup()
    name = env.topology.engine_name(engine_id)
    env.start_heartbeat(name)
    try:
        if env.topology.is_pe(engine_id):
            from dualpath.runtime.prefill import PrefillEngine

            engine: Engine = PrefillEngine(env, engine_id, crash_at)
        else:
            from dualpath.runtime.decode import DecodeEngine

            engine = DecodeEngine(env, engine_id, crash_at)
        engine.serve(inbox)
    except Exception as err:
        env.results.put(ErrorMsg(name, f"{type(err).__name__}: {err}"))
        raise
