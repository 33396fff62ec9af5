"""What PE and DE processes share: the model, a paged HBM pool, the CNIC, the loop.

"HBM" is an ``HbmPool`` of Layer-Block pages registered with the transport, so Layer Blocks
land in it by transport and torch reads it in place. Every byte into or out of the engine
passes its CNIC pacer (``rx`` in, ``tx`` out); a transfer to or from another node's buffer is
also charged on that node's CNIC of the same rail, and every transfer touching a node buffer
on the node's DRAM (shared links, ``pacer.transfer_all``). At most ``transfer_window``
transfers of one engine thread are outstanding (``TransferWindow``).
"""

from __future__ import annotations

import os
import queue
import signal
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dualpath.kv.pacer import NicPacer, Pacer, transfer_all
from dualpath.kv.transport import make_transport
from dualpath.kv.transport.base import RegionHandle, Transfer
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.gputime import GpuTime
from dualpath.runtime.hbm import HbmPool
from dualpath.runtime.messages import ReadyMsg, RegionsMsg, StopMsg
from dualpath.runtime.model import CacheBatch, KVCache, RuntimeModel
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.token_choice import Chooser, GrammarCache, build_tokenizer
from dualpath.types import TrafficClass

POLL_S = 0.5


class TransferWindow:
    """Issued transfers of one thread, at most ``size`` outstanding: adding one more waits
    for the oldest, so transport latency overlaps the issuing of the next ones."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._open: deque[Transfer] = deque()

    def add(self, transfer: Transfer) -> None:
        self._open.append(transfer)
        while len(self._open) > self.size:
            self._open.popleft().wait()

    def drain(self) -> None:
        while self._open:
            self._open.popleft().wait()


class Engine:
    """Base of PE and DE engine processes (one per emulated GPU)."""

    def __init__(self, env: ProcEnv, engine_id: int, crash_at: int) -> None:
        self.env = env
        self.engine_id = engine_id
        self.node = env.topology.node_of(engine_id)
        self.rail = engine_id % env.topology.gpus_per_node  # local index: the CNIC's rail
        self.name = env.topology.engine_name(engine_id)
        self.clock = env.clock
        m = env.config.model
        self.model: RuntimeModel = env.build_model(engine_id)
        self.row_bytes = m.kv_bytes_per_token_per_layer
        if self.model.kv_row_bytes != self.row_bytes or self.model.num_layers != m.num_layers:
            raise ValueError(
                f"{self.model.name}: {self.model.num_layers} layers of {self.model.kv_row_bytes} "
                f"KV bytes per token, but the config says {m.num_layers} of {self.row_bytes}"
            )
        self.block_tokens = env.block_tokens
        self.pool = HbmPool(
            env.options.hbm_pages(m.num_layers, self.block_tokens, env.topology.is_pe(engine_id)),
            self.block_tokens,
            m.num_kv_heads,
            m.head_dim,
            self.model.dtype,
        )
        self.transport = make_transport(env.options.transport)
        self.hbm: RegionHandle = self.transport.register(
            f"hbm{engine_id}", memoryview(self.pool.region)
        )
        self._cnics: dict[int, NicPacer] = {}
        self.cnic = self.cnic_of(engine_id)
        self._drams: dict[int, Pacer] = {}
        self.ready_region: RegionHandle | None = None  # announced in the readiness ack
        env.publish_nic_busy(f"cnic_engine{engine_id}_tx", [self.cnic.tx, self.cnic.rx])
        self.paced = env.options.paced_kv
        self.layer_block_bytes = env.layout.layer_block_bytes
        self._crash_at = crash_at
        self._num_work = 0
        # warm up (lazy kernel setup) before the readiness ack, as a serving engine would
        warm = [KVCache(self.model, 2), KVCache(self.model, 2)]
        self.model.forward_batch([[0], [0, 1]], CacheBatch(warm))
        self._grammars: GrammarCache | None = None
        # emulated GPU time: the cost model on the run's hardware (None: host time)
        self.gpu_time: GpuTime | None = None
        if env.options.gpu_time == "emulated":
            self.gpu_time = GpuTime(
                env.config.model,
                env.config.hardware,
                len(env.group_members(engine_id)),
                env.topology.decode_ep_gpus,
            )

    def chooser(self, sampling: SamplingParams | None, prefix: Sequence[int] = ()) -> Chooser:
        """A request's token chooser; the grammar library's tokenizer is built on the first
        constrained request (about a second for a large vocabulary) and kept, and so is each
        grammar compiled (``GrammarCache``)."""
        if sampling is not None and sampling.grammar and self._grammars is None:
            vocab = self.env.options.vocab
            if vocab is None:
                raise ValueError("a grammar-constrained request, but RuntimeOptions.vocab is unset")
            tokenizer = build_tokenizer(vocab, self.model.vocab_size)
            self._grammars = GrammarCache(tokenizer, self.model.vocab_size)
        return Chooser(sampling, prefix, self._grammars)

    def cnic_of(self, engine: int) -> NicPacer:
        """Engine ``engine``'s CNIC (shared links, so this process's charges contend with its
        owner's)."""
        if engine in self._cnics:
            return self._cnics[engine]
        nic = self._cnics[engine] = NicPacer.of(
            self.env.config.hardware.cnic_bytes_per_s,
            f"cnic{engine}",
            clock=self.clock.now,
            links=self.env.cnic_links(engine),
        )
        return nic

    def _route(self, node: int, receive: bool) -> list[Pacer]:
        """The links a KV transfer between this engine's HBM and node ``node``'s buffer
        crosses (as the simulator routes it, docs/simulator.md): to another node, this CNIC
        (rx to receive, tx to send) and the other direction of that node's CNIC on the same
        rail (the engine with this engine's local index); within the node, a loopback through
        both directions of this CNIC; either way the node's DRAM."""
        if node == self.node:
            route = [self.cnic.rx, self.cnic.tx]
        else:
            far = self.cnic_of(node * self.env.topology.gpus_per_node + self.rail)
            route = [self.cnic.rx, far.tx] if receive else [self.cnic.tx, far.rx]
        link = self.env.dram_link(node)
        if link is not None:
            if node not in self._drams:
                rate = self.env.config.hardware.dram_bytes_per_s
                self._drams[node] = Pacer(rate, f"dram{node}", clock=self.clock.now, link=link)
            route.append(self._drams[node])
        return route

    def pull_nowait(
        self,
        node: int,
        slot: int,
        layer: int,
        first: int,
        num_tokens: int,
        page: int,
        paced: bool = True,
    ) -> tuple[int, Transfer]:
        """Issue Layer Block rows ``first..first+num_tokens`` of ``slot`` in node ``node``'s
        buffer → the same rows of HBM page ``page`` (paced on every link of ``_route``, unless
        the caller charged it already: ``paced=False``); the caller waits on the transfer,
        so several can be outstanding (a window)."""
        return self._move_nowait(node, slot, layer, first, num_tokens, page, True, paced)

    def push_nowait(
        self,
        node: int,
        slot: int,
        layer: int,
        first: int,
        num_tokens: int,
        page: int,
        paced: bool = True,
    ) -> tuple[int, Transfer]:
        """Issue rows ``first..`` of HBM page ``page`` → the same rows of ``slot``'s Layer
        Block ``layer`` (paced on every link of ``_route`` unless ``paced=False``); the caller
        waits on the transfer."""
        return self._move_nowait(node, slot, layer, first, num_tokens, page, False, paced)

    def charge(self, node: int, nbytes: int, to_hbm: bool) -> None:
        """Pace ``nbytes`` between this engine's HBM and node ``node``'s buffer as one
        transfer on every link of ``_route`` (a batch of transfers posted together: one
        reservation per link instead of one per Layer Block, the same link time)."""
        if self.paced and nbytes > 0:
            transfer_all(self._route(node, to_hbm), nbytes, TrafficClass.LOW)

    def _move_nowait(
        self,
        node: int,
        slot: int,
        layer: int,
        first: int,
        num_tokens: int,
        page: int,
        to_hbm: bool,
        paced: bool = True,
    ) -> tuple[int, Transfer]:
        nbytes = num_tokens * self.row_bytes
        if self.paced and paced:
            transfer_all(self._route(node, to_hbm), nbytes, TrafficClass.LOW)
        spec = self.env.buffers[node]
        offset = slot * spec.stride_bytes + layer * self.layer_block_bytes + first * self.row_bytes
        move = self.transport.read if to_hbm else self.transport.write
        done = move(self.hbm, self.pool.offset(page, first), self.env.region(node), offset, nbytes)
        return nbytes, done

    def handle(self, msg: Any) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Work to do without a new message (a DE's running batch)."""
        return False

    def step(self) -> None:
        """One unit of that work (a DE's batched decode step), between messages."""

    def serve(self, inbox: Any) -> None:
        """Ack, then handle every message that has arrived before each unit of work (so new
        requests join a DE's running batch at its next step, not one per step)."""
        self.env.results.put(ReadyMsg(self.name, os.getpid(), self.ready_region))
        while self.env.parent_alive():
            try:
                msg = inbox.get_nowait() if self.has_work() else inbox.get(timeout=POLL_S)
            except queue.Empty:
                msg = None
            while msg is not None:
                if isinstance(msg, StopMsg):
                    self.close()
                    return
                self._dispatch(msg)
                try:
                    msg = inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self.has_work():
                self.step()
        self.close()

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, RegionsMsg):  # sent once after spawn, before any work
            self.env = replace(self.env, regions=msg.regions)
            return
        self._num_work += 1
        if self._num_work == self._crash_at:  # fault injection: die or stall, mid-run
            if self.env.options.faults.crash_mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(17)
        self.handle(msg)

    def close(self) -> None:
        self.transport.close()
