"""Turns in, up to their PE's queue: submission (checks, hits from the KV store's hash chain),
the policy's assignments at a pull, buffer slots (FIFO: a turn that does not fit waits, the
backpressure), storage reads and their completion. Owns the turn table and the slot queue;
hands a turn whose hit KV is in a buffer back to the caller (it never queues it on a PE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dualpath.kv.store import KVStore, block_keys
from dualpath.ledger import Core, Phase
from dualpath.ledger.counters import RunCounters
from dualpath.ledger.turn import usable_hit_tokens
from dualpath.metrics.hops import hop
from dualpath.runtime.env import ProcEnv
from dualpath.runtime.messages import ReadDoneMsg, ReadMsg
from dualpath.runtime.requests import AgentState, Req
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.slots import Slots
from dualpath.types import KVPath, ReadSide


class Intake:
    def __init__(
        self,
        send_storage: Callable[[int, Any], None],
        env: ProcEnv,
        core: Core[AgentState, Req],
        slots: Slots,
        counters: RunCounters,
        hbm_pages: int,
        now: Callable[[], float],
    ) -> None:
        self.send_storage = send_storage  # (node, message) → its current storage worker
        self.env = env
        self.core = core
        self.slots = slots
        self.counters = counters
        self.hbm_pages = hbm_pages
        self.now = now
        self.store: KVStore = env.store()
        self.block = env.block_tokens
        self.num_layers = env.config.model.num_layers
        self.reqs: dict[int, Req] = core.turns
        self.next_rid = 0
        self.alloc_wait: list[int] = []  # assigned, waiting for buffer slots (FIFO)

    def submit(
        self,
        agent: AgentState,
        append: tuple[int, ...],
        output_tokens: int,
        arrival_s: float | None = None,
        sampling: SamplingParams | None = None,
    ) -> Req:
        """Build and submit ``agent``'s next turn (arrived at ``arrival_s``, default now;
        ``sampling`` None: greedy); ValueError on a bad request."""
        agent_id = agent.agent_id
        if not append:
            raise ValueError(f"request for agent {agent_id} is invalid: empty prompt append")
        if output_tokens < 1:
            raise ValueError(
                f"request for agent {agent_id}: output_tokens={output_tokens} must be >= 1"
            )
        vocab = self.env.config.model.vocab_size
        if any(not 0 <= t < vocab for t in append):
            raise ValueError(f"request for agent {agent_id}: token ids must be in 0..{vocab - 1}")
        tokens = (*agent.context, *append)
        limit = self.env.config.model.max_context_tokens
        if len(tokens) + output_tokens > limit:
            raise ValueError(
                f"request for agent {agent_id} is invalid: {len(tokens)} prompt + {output_tokens} "
                f"output tokens exceed the model's context limit of {limit}"
            )
        pages = -(-(len(tokens) + output_tokens) // self.block) * self.num_layers
        if pages > self.hbm_pages:
            pool = self.hbm_pages // self.num_layers * self.block
            raise ValueError(
                f"request for agent {agent_id} is invalid: {len(tokens)} prompt + {output_tokens} "
                f"output tokens exceed an engine's HBM pool of {pool} tokens"
            )
        namespace = self.namespace(agent)
        keys = block_keys(tokens, self.block, namespace)
        hit = usable_hit_tokens(self.store.lookup(keys), len(tokens), self.block)
        arrival = self.now() if arrival_s is None else arrival_s
        req = Req(
            self.next_rid,
            agent_id,
            agent.turn,
            tokens,
            output_tokens,
            tuple(keys),
            hit,
            arrival,
            sampling=sampling,
            namespace=namespace,
        )
        self.next_rid += 1
        hop("sched.submit", req.request_id)
        self.core.submit(req, arrival)
        return req

    def namespace(self, agent: AgentState) -> str:
        return self.env.namespace_for(agent.tenant or self.env.options.tenant)

    def keys(self, agent: AgentState, append: tuple[int, ...]) -> list[str]:
        """The block keys of ``agent``'s next turn's prompt (its context, then ``append``)."""
        return block_keys((*agent.context, *append), self.block, self.namespace(agent))

    def admit(self) -> None:
        """A pull: the policy's assignments wait for their buffer slots; a turn whose client
        left while the policy held it is aborted now (it holds nothing yet)."""
        for req, reads in self.core.pull(self.now()):
            if reads:  # one read: the runtime does not split reads
                (req.read_node, _), *rest = reads
                assert not rest, "split reads reached the runtime"
            hop("sched.assigned", req.request_id)
            self.alloc_wait.append(req.request_id)

    def alloc_round(self) -> list[Req]:
        """Give waiting turns their buffer slots, FIFO; returns those that got them, in order
        (a turn that does not fit waits, and is counted as a stall)."""
        still: list[int] = []
        ready: list[Req] = []
        try:
            for rid in self.alloc_wait:
                req = self.reqs[rid]
                if req.phase is Phase.ABORTED:
                    continue
                if not self.slots.alloc(req):
                    self.counters.alloc_stalls += 1
                    still.append(rid)
                    continue
                ready.append(req)
        finally:
            self.alloc_wait = still
        return ready

    def start_read(self, req: Req, retry: bool = False) -> bool:
        """Send ``req``'s storage read (``retry``: again, after a storage respawn); False when
        it has nothing to read (its KV is ready now)."""
        if req.read_side is ReadSide.NONE:
            return False
        nblocks = req.hit_tokens // self.block
        if not retry:
            full = self.env.layout.full_block_bytes
            self.core.read_started(req, req.read_node, nblocks * full, self.now())
        hop("sched.read_sent", req.request_id)
        slots = req.pe_slots if req.read_side is ReadSide.PE else req.de_slots
        self.send_storage(
            req.read_node, ReadMsg(req.request_id, req.keys[:nblocks], tuple(slots[:nblocks]))
        )
        return True

    def read_done(self, req: Req, msg: ReadDoneMsg) -> bool:
        """``req``'s read came back; False for a read re-issued after a storage respawn whose
        first answer was already taken (done once)."""
        if req.phase is not Phase.READING:
            return False
        hop("sched.read_done", req.request_id)
        from_storage = msg.num_ok - msg.num_from_tier
        if from_storage or not msg.num_from_tier:  # the SNIC worked (a tier copy: it idled)
            self.counters.read_window(msg.node_id, msg.start_s, msg.done_s)
        req.cached = req.hit_tokens = msg.num_ok * self.block  # what was read and verified
        on_pe = req.read_side is ReadSide.PE
        path = KVPath.STORAGE_TO_PE_BUFFER if on_pe else KVPath.STORAGE_TO_DE_BUFFER
        full = self.env.layout.full_block_bytes
        self.counters.moved(path, from_storage * full)
        if msg.num_from_tier:  # found in the node's DRAM tier (dram-tier, docs/peers.md)
            self.counters.moved(KVPath.PE_DRAM_TO_PE_HBM, msg.num_from_tier * full)
        self.core.read_done(req, req.read_node, max(msg.done_s, req.read_start_s))
        return True

    def lost_reads(self, node: int) -> list[Req]:
        """Turns whose read is out on ``node`` (its storage worker died), by id."""
        reqs = self.reqs.items()
        return [r for _, r in sorted(reqs) if r.phase is Phase.READING and r.read_node == node]

    def live(self) -> bool:
        """Some turn is neither done nor aborted."""
        return any(not r.phase.over for r in self.reqs.values())
