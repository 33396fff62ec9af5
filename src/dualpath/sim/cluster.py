"""The simulated cluster: carries out the policy's decisions on nodes, PE and DE groups.

Carries out each turn (submit → assign → read → prefill → H2D → decode → finish) and reports
what happened to the ledger, which keeps the counters and the view the policy sees (design
§13.4) and the turn records. All timing comes from the cost model and the fluid network; all
decisions come from ``dualpath.policy``: this is a shell, carrying out decisions, making none
(docs/architecture.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from dualpath.config import Config, config_for
from dualpath.config.sim import SimConfig
from dualpath.config.systems import SystemSpec
from dualpath.ledger import (
    EventBus,
    Persisted,
    Topology,
    decode_block_tokens,
    prompt_block_tokens,
)
from dualpath.ledger.core import Core
from dualpath.ledger.counters import SIM_PATHS
from dualpath.ledger.residency import Residency
from dualpath.metrics import TurnRecord
from dualpath.models import cost
from dualpath.policy import ClusterView, make_policy
from dualpath.sim.channel import Channel
from dualpath.sim.decode import DecodeGroup
from dualpath.sim.events import Event, EventLoop, Priority
from dualpath.sim.fabric import Fabric
from dualpath.sim.network import FluidNetwork
from dualpath.sim.node_io import NodeIO
from dualpath.sim.prefill import PrefillGroup
from dualpath.sim.request import Req
from dualpath.sim.transfers import Transfers
from dualpath.types import EngineKind, KVPath, ReuseSource
from dualpath.workload import TurnSpec


class Cluster:
    """One system on one cluster. ``add_agent`` queues an agent's turns (turn i+1 is submitted
    when turn i's last token is out: zero think time); ``loop.run`` drives everything."""

    def __init__(self, config: Config, system: SystemSpec, sim: SimConfig) -> None:
        self.config = config = config_for(config, system)
        self.system = system
        self.sim = sim
        model, hw = config.model, config.hardware
        self.loop = loop = EventLoop()
        self.net = FluidNetwork(loop, traffic_manager=sim.traffic_manager, low_floor=sim.low_floor)
        self.topo = topo = Topology.from_config(config)
        self.fabric = fabric = Fabric(topo, hw, self.net.add_resource, sim.rail_matched)
        self.events = EventBus()  # what happened, for observers (traces, metrics)
        self.kv_per_token = cost.kv_bytes_per_token(model)
        self.block_tokens = config.scheduler.block_tokens
        de_gpus = topo.decode_ep_gpus  # a DE's weights are sharded over its EP group
        self.hbm_capacity_tokens = cost.kv_capacity_tokens(model, hw, de_gpus)
        self.residency = self._residency() if system.reuse else None
        paths = SIM_PATHS
        if system.reuse:  # the reuse designs' hops (absent from the paper's systems' results)
            paths = (*SIM_PATHS, KVPath.PE_DRAM_TO_PE_HBM, KVPath.PEER_TO_PE_HBM)
        # the one door to the policy, the ledger (and its records), the run's counters (bytes
        # per load path, counted by the transfers) and the agent driver
        self.core: Core[_Agent, Req] = Core(
            topo,
            make_policy(config),
            self.hbm_capacity_tokens,
            self.block_tokens,
            self._submit,
            self.events,
            paths,
            self.residency,
        )
        self.reqs = self.core.turns
        self.records: list[TurnRecord] = self.core.records
        self.transfers = Transfers(
            loop, self.net, oracle=system.oracle, events=self.events, counters=self.core.counters
        )
        self.node_ios: list[NodeIO] = []
        for n in range(topo.num_nodes):
            pe_node = topo.kind_of_node(n) is EngineKind.PE
            self.node_ios.append(
                NodeIO(
                    n,
                    KVPath.STORAGE_TO_PE_BUFFER if pe_node else KVPath.STORAGE_TO_DE_BUFFER,
                    fabric.read_path(n),
                    hw.pe_buffer_bytes if pe_node else hw.de_buffer_bytes,
                    sim.reads_per_node,
                    self.transfers,
                    self._on_read_done,
                    self._on_read_start,
                )
            )
        on_persisted = self._on_persisted if sim.next_turn_after_persist else None
        self.writers: dict[int, Channel[Req]] = {
            n: Channel(
                KVPath.DE_TO_STORAGE,
                fabric.persist_path(n),
                self.transfers,
                on_persisted,
                # writes that gate turns start at once and land in order, each with its own
                # bytes (batched with later ones, a turn would wait for bytes sent after its
                # own); only writes that gate nothing are spaced to be batched
                min_gap_s=0.0 if sim.next_turn_after_persist else sim.persist_interval_s,
                coalesce=not sim.next_turn_after_persist,
            )
            for n in range(topo.num_prefill_nodes, topo.num_nodes)
        }
        # sim.next_turn_after_persist: each turn's block writes in flight, in the order sent
        # (a node's writes land in that order); the agent driver holds the next turns
        self._unpersisted: dict[int, list[int]] = {}
        self._num_writes = 0
        self.h2d: dict[int, Channel[Req]] = {
            de: Channel(
                KVPath.DE_BUFFER_TO_DE_HBM, fabric.h2d_path(de), self.transfers, self._on_h2d
            )
            for de in topo.de_ids
        }
        self._build_groups()
        for group in self.decode_groups:
            self.core.track_decode(group.members, group.generated_by_member, group.generated_stamp)
        self._next_request_id = 0
        self.num_turns_total = 0
        self.num_turns_done = 0
        self.num_pulls = 0
        self.scheduler_s = 0.0  # host seconds spent building views and in policy.schedule
        self._pull_event: Event | None = None
        self._last_pull_s = -float("inf")
        self._blocked = False  # the last pull left requests waiting for capacity
        self._expiry_wake = -math.inf  # a pull is set for this pinned hold's expiry

    def _residency(self) -> Residency:
        """The stores of the system's reuse mechanism (docs/peers.md), sized by
        ``config.reuse`` and the cost model's HBM KV capacities."""
        config, topo = self.config, self.topo
        model, hw, reuse = config.model, config.hardware, config.reuse
        # a PE's KV space as its group's passes see it (``PrefillGroup.kv_budget_tokens``)
        pe_gpus = max((len(m) for _, m in topo.groups(EngineKind.PE)), default=1)
        pe_tokens = cost.kv_capacity_tokens(model, hw, pe_gpus) * reuse.prefix_cache_share
        dram = reuse.resident_bytes if self.system.reuse == "resident" else reuse.dram_tier_bytes
        return Residency(
            self.system.reuse,
            node_of=[topo.node_of(e) for e in topo.engine_ids],
            pe_ids=topo.pe_ids,
            de_ids=topo.de_ids,
            num_nodes=topo.num_nodes,
            block_tokens=self.block_tokens,
            pe_capacity_tokens=int(pe_tokens),
            de_capacity_tokens=self.hbm_capacity_tokens,
            dram_capacity_tokens=int(dram // cost.kv_bytes_per_token(model)),
            ttl_s=reuse.d2p_ttl_s,
            on_pinned=self._pin,
        )

    def _pin(self, de: int, tokens: int) -> None:
        self.core.pin(de, tokens)

    def _build_groups(self) -> None:
        config, topo, sim = self.config, self.topo, self.sim
        model, hw = config.model, config.hardware
        pe_groups = [members for _, members in topo.groups(EngineKind.PE)]
        self.prefill_groups = [
            PrefillGroup(
                members,
                loop=self.loop,
                core=self.core,
                fabric=self.fabric,
                transfers=self.transfers,
                node_ios=self.node_ios,
                reqs=self.reqs,
                model=model,
                hw=hw,
                layerwise=self.system.layerwise,
                per_layer=sim.per_layer,
                collectives=sim.collectives,
                on_prefill_done=self._on_prefill_done,
                events=self.events,
                read_ahead_requests=sim.classic_read_ahead_requests,
                read_ahead_bytes=sim.classic_read_ahead_bytes,
            )
            for members in pe_groups
        ]
        self.prefill_group_of = {pe: g for g in self.prefill_groups for pe in g.members}
        de_gpus = topo.decode_ep_gpus  # weights sharded over
        de_groups = [members for _, members in topo.groups(EngineKind.DE)]
        self.decode_groups = [
            DecodeGroup(
                members,
                loop=self.loop,
                model=model,
                hw=hw,
                num_gpus=de_gpus,
                macro_steps=sim.decode_macro_steps,
                on_finish=self._finish,
                events=self.events,
                h2d_bytes_per_token=0.0 if self.system.oracle else self.kv_per_token,
                d2h_bytes_per_token=(
                    self.kv_per_token if sim.persistence and not self.system.oracle else 0.0
                ),
            )
            for members in de_groups
        ]
        self.decode_group_of = {de: g for g in self.decode_groups for de in g.members}

    # ------------------------------------------------------------------ agents and turns
    def add_agent(self, agent_id: int, turns: Sequence[TurnSpec], start_s: float) -> None:
        """Agent ``agent_id`` submits its first turn at ``start_s`` (offline: 0; online: its
        arrival), each later turn when the previous one finished."""
        if agent_id in self.core.agents:
            raise ValueError(f"agent_id={agent_id} is invalid: added twice")
        if not turns:
            raise ValueError(f"agent {agent_id}: no turns")
        budgets = [g.kv_budget_tokens for g in self.prefill_groups if g.kv_budget_tokens]
        if budgets:  # refused up front, not mid-run
            budget = min(budgets)
            big = max(turns, key=lambda t: t.prompt_tokens)
            if big.prompt_tokens > budget:
                raise ValueError(
                    f"agent {agent_id}, turn {big.turn_index}: prompt_tokens="
                    f"{big.prompt_tokens} exceeds a PE's HBM KV budget of {budget} tokens; "
                    f"system {self.system.name!r} is not layerwise, so a PE holds the whole "
                    "prompt's KV in HBM during its pass and cannot prefill this turn "
                    "(chunking does not shrink it; use a layerwise system or more HBM)"
                )
        self.core.agents.add(_Agent(agent_id, turns))
        self.num_turns_total += len(turns)
        agents = self.core.agents
        self.loop.at(
            start_s,
            lambda: agents.next_turn(agent_id, self.loop.now),
            Priority.COMPLETION,
            "agent_start",
        )

    def _submit(self, agent: _Agent, arrival_s: float) -> None:
        """The agent driver's: submit ``agent``'s next turn now; it arrived at ``arrival_s``."""
        spec = agent.turns[agent.submitted]
        agent.submitted += 1
        now = self.loop.now
        rid = self._next_request_id
        self._next_request_id += 1
        req = Req(
            rid,
            agent.agent_id,
            spec.turn_index,
            spec.prompt_tokens,
            spec.hit_tokens,
            spec.output_tokens,
            arrival_s,
        )
        self.core.submit(req, now)
        self.request_pull(capacity_freed=False)

    # ------------------------------------------------------------------ pulls (design §7.1)
    def request_pull(self, capacity_freed: bool = True) -> None:
        """Group leaders pull at most once per ``pull_interval_s``, when capacity was freed
        (a prefill or a request finished) or when a request arrives and nothing is blocked
        (behind a blocked FIFO head a new request cannot be placed either)."""
        if capacity_freed:
            self._blocked = False
        elif self._blocked:
            return
        if self._pull_event is not None:
            return
        when = max(self.loop.now, self._last_pull_s + self.sim.pull_interval_s)
        self._pull_event = self.loop.at(when, self._pull, Priority.PULL, "pull")

    def _pull(self) -> None:
        self._pull_event = None
        if not self.core.waiting:
            return
        now = self.loop.now
        self._last_pull_s = now
        self.num_pulls += 1
        start = time.perf_counter()  # host time, reported only (benchmarks/bench_scale.py)
        assigned = self.core.pull(now, read=not self.system.oracle)
        self.scheduler_s += time.perf_counter() - start
        for req, reads in assigned:
            self._assign(req, reads)
        self._blocked = self.core.waiting > 0
        if self._blocked and self.residency is not None and self.residency.pinned:
            self._wake_at_expiry()

    def _wake_at_expiry(self) -> None:
        """Pinned holds free DE HBM when their TTL ends, an event no engine reports: pull
        again just after the next one, so that waiting turns are not stranded."""
        assert self.residency is not None
        when = self.residency.next_expiry_s()
        if math.isfinite(when) and self._expiry_wake < when:
            self._expiry_wake = when = math.nextafter(when, math.inf)
            self.loop.at(when, self.request_pull, Priority.PULL, "expiry")

    def view(self) -> ClusterView:
        """What the engines report at a pull (the ledger's view)."""
        return self.core.view()

    # ------------------------------------------------------------------ lifecycle
    def _assign(self, req: Req, reads: list[tuple[int, int]]) -> None:
        group = self.prefill_group_of[req.pe]
        if not reads:
            group.offer(req, 0.0, None)
            return
        kvpt = self.kv_per_token
        req.pe_buffer_bytes = float(req.pe_read_tokens * kvpt)
        req.de_buffer_bytes += float((req.de_read_tokens + req.de_prefetch_tokens) * kvpt)
        group.offer(req, sum(t for _, t in reads) * kvpt, partial(self._start_reads, req, reads))

    def _start_reads(self, req: Req, reads: list[tuple[int, int]]) -> None:
        kvpt = self.kv_per_token
        for node, tokens in reads:
            self.node_ios[node].enqueue(req, tokens, tokens * kvpt)

    def _on_read_start(self, req: Req, node: int, size_bytes: float) -> None:
        self.core.read_started(req, node, size_bytes, self.loop.now)

    def _on_read_done(self, req: Req, node: int) -> None:
        if self.core.read_done(req, node, self.loop.now):
            self.prefill_group_of[req.pe].read_done(req)

    def _on_prefill_done(self, req: Req) -> None:
        now = self.loop.now
        self.core.first_token(req, now)
        pe, de = req.pe, req.de
        if req.pe_buffer_bytes:
            self.node_ios[self.topo.node_of(pe)].release(req.pe_buffer_bytes)
        new_blocks = prompt_block_tokens(req, self.block_tokens)
        if new_blocks > 0:  # the turn's new prompt blocks
            self._persist(req, new_blocks)
        self.request_pull()
        if req.output_tokens == 1:
            req.second_token_s = req.finish_s = now
            self._release_de_buffer(req)
            self._finish(req)
            return
        on_de = req.reuse_tokens if req.reuse_source is ReuseSource.DE_HBM else 0
        self.h2d[de].send((req.prompt_tokens - on_de) * self.kv_per_token, req)

    def _persist(self, req: Req, tokens: int) -> None:
        """Hand ``tokens`` of ``req``'s whole KV blocks in its DE's node buffer to storage."""
        if not self.sim.persistence or not self.system.persist:
            return
        node, num_bytes = self.topo.node_of(req.de), tokens * self.kv_per_token
        if self.sim.next_turn_after_persist:  # the agent's next turn waits for this write
            self._num_writes += 1
            self._unpersisted.setdefault(req.request_id, []).append(self._num_writes)
            self.writers[node].send(num_bytes, req)
        else:
            self.writers[node].send(num_bytes)
        if self.events.wants(Persisted):
            self.events.emit(Persisted(self.loop.now, node, num_bytes, req))

    def _release_de_buffer(self, req: Req) -> None:
        if req.de_buffer_bytes:
            self.node_ios[self.topo.node_of(req.de)].release(req.de_buffer_bytes)
            req.de_buffer_bytes = 0.0

    def _on_h2d(self, reqs: list[Req]) -> None:
        """The prompt KV of ``reqs`` reached DE HBM: free the DE buffer, join the batch."""
        for req in reqs:
            self._release_de_buffer(req)
            self.decode_group_of[req.de].join(req)

    def _finish(self, req: Req) -> None:
        """The last token is out (``req.finish_s`` set): free the DE, record, next turn
        (``sim.next_turn_after_persist``: once the turn's block writes have landed)."""
        self.core.finish(req, self.loop.now)  # records it (TurnDone)
        filled = decode_block_tokens(req, self.block_tokens)
        if filled > 0:  # blocks filled during decode
            self._persist(req, filled)
        self.core.forget(req.request_id)
        self.num_turns_done += 1
        self.request_pull()
        # the next turn arrives now (zero think time); held: at this turn's finish
        pending = self._unpersisted.get(req.request_id, ())
        arrival_s = req.finish_s if pending else self.loop.now
        self.core.agents.next_turn(req.agent_id, arrival_s, pending)

    def _on_persisted(self, reqs: list[Req]) -> None:
        """A persistence write landed (one entry per write it carried): the agent driver
        submits the next turns that waited only on it."""
        for req in reqs:
            writes = self._unpersisted[req.request_id]
            write = writes.pop(0)
            if not writes:
                del self._unpersisted[req.request_id]
            self.core.agents.durable(write)


@dataclass(slots=True)
class _Agent:
    """An agent's turns and how many of them were submitted (for the agent driver)."""

    agent_id: int
    turns: Sequence[TurnSpec]
    submitted: int = 0

    @property
    def finished(self) -> bool:
        return self.submitted >= len(self.turns)
