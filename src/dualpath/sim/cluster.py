"""The simulated cluster: carries out the policy's decisions on nodes, PE and DE groups.

Owns the request lifecycle (submit → assign → read → prefill → H2D → decode → finish) and the
engine counters the policy sees (SPEC §13.4). All timing comes from the cost model and the
fluid network; all decisions come from ``dualpath.policy`` (STYLE §1: this is a shell).
"""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.config import Config
from dualpath.config.sim import SimConfig
from dualpath.metrics import TurnRecord
from dualpath.models import cost
from dualpath.policy import Assign, ClusterView, EngineState, NodeState, RequestInfo, make_policy
from dualpath.sim.channel import Channel
from dualpath.sim.decode import DecodeGroup
from dualpath.sim.events import Event, EventLoop
from dualpath.sim.network import FluidNetwork
from dualpath.sim.node_io import NodeIO
from dualpath.sim.prefill import PrefillGroup
from dualpath.sim.request import Req
from dualpath.sim.systems import SystemSpec, config_for
from dualpath.sim.topology import Topology
from dualpath.sim.transfers import Transfers
from dualpath.types import EngineKind, ReadSide
from dualpath.workload import TurnSpec

PULL_PRIORITY = 3  # a pull runs after every completion of its instant
_PE, _DE = EngineKind.PE, EngineKind.DE


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
        self.topo = topo = Topology(config, self.net.add_resource, sim.rail_matched)
        self.transfers = Transfers(loop, self.net, oracle=system.oracle)
        self.policy = make_policy(config)
        self.kv_per_token = cost.kv_bytes_per_token(model)
        self.block_tokens = config.scheduler.block_tokens
        self.node_ios: list[NodeIO] = []
        for n in range(topo.num_nodes):
            pe_node = topo.kind_of_node(n) is EngineKind.PE
            self.node_ios.append(
                NodeIO(
                    n,
                    "storage_to_pe_buffer" if pe_node else "storage_to_de_buffer",
                    topo.read_path(n),
                    hw.pe_buffer_bytes if pe_node else hw.de_buffer_bytes,
                    sim.reads_per_node,
                    self.transfers,
                    self._on_read_done,
                )
            )
        self.writers: dict[int, Channel[Req]] = {
            n: Channel(
                "de_to_storage",
                topo.persist_path(n),
                self.transfers,
                min_gap_s=sim.persist_interval_s,
            )
            for n in range(topo.num_prefill_nodes, topo.num_nodes)
        }
        self.h2d: dict[int, Channel[Req]] = {
            de: Channel("de_buffer_to_de_hbm", topo.h2d_path(de), self.transfers, self._on_h2d)
            for de in topo.de_ids
        }
        num_engines = len(topo.engine_ids)
        self.seq = [0] * num_engines  # seq_e
        self.tok = [0] * num_engines  # tok_e (DEs: + tokens generated, from the decode group)
        self.reserved = [0] * num_engines  # DE HBM reserved, tokens
        self.reqs: dict[int, Req] = {}
        self.records: list[TurnRecord] = []
        self._build_groups()
        self._agents: dict[int, tuple[Sequence[TurnSpec], list[int]]] = {}
        self._next_request_id = 0
        self.num_turns_total = 0
        self.num_turns_done = 0
        self.num_pulls = 0
        self._pull_event: Event | None = None
        self._last_pull_s = -float("inf")
        self._blocked = False  # the last pull left requests waiting for capacity
        # per engine: the (seq, tokens, free) last reported and the EngineState built from it
        self._keys: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(topo.engine_ids)
        self._states = [
            EngineState(e, topo.node_of(e), topo.group_of(e), _kind(topo, e))
            for e in topo.engine_ids
        ]
        self._node_cache = [NodeState(n, topo.kind_of_node(n), 0) for n in range(topo.num_nodes)]
        self._where = [(topo.node_of(e), topo.group_of(e)) for e in topo.engine_ids]

    def _build_groups(self) -> None:
        config, topo, sim = self.config, self.topo, self.sim
        model, hw = config.model, config.hardware
        pe_groups = [members for _, members in topo.groups(EngineKind.PE)]
        self.prefill_groups = [
            PrefillGroup(
                members,
                loop=self.loop,
                policy=self.policy,
                topo=topo,
                transfers=self.transfers,
                node_ios=self.node_ios,
                reqs=self.reqs,
                model=model,
                hw=hw,
                layerwise=self.system.layerwise,
                per_layer=sim.per_layer,
                collectives=sim.collectives,
                on_prefill_done=self._on_prefill_done,
            )
            for members in pe_groups
        ]
        self.prefill_group_of = {pe: g for g in self.prefill_groups for pe in g.members}
        de_gpus = topo.decode_group_gpus if topo.decode_ep else 1  # weights sharded over
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
                h2d_bytes_per_token=0.0 if self.system.oracle else self.kv_per_token,
                d2h_bytes_per_token=(
                    self.kv_per_token if sim.persistence and not self.system.oracle else 0.0
                ),
            )
            for members in de_groups
        ]
        self.decode_group_of = {de: g for g in self.decode_groups for de in g.members}
        self.hbm_capacity_tokens = cost.kv_capacity_tokens(model, hw, de_gpus)

    # ------------------------------------------------------------------ agents and turns
    def add_agent(self, agent_id: int, turns: Sequence[TurnSpec], start_s: float) -> None:
        """Agent ``agent_id`` submits its first turn at ``start_s`` (offline: 0; online: its
        arrival), each later turn when the previous one finished."""
        if agent_id in self._agents:
            raise ValueError(f"agent_id={agent_id} is invalid: added twice")
        if not turns:
            raise ValueError(f"agent {agent_id}: no turns")
        self._agents[agent_id] = (turns, [0])
        self.num_turns_total += len(turns)
        self.loop.at(start_s, lambda: self._submit_next(agent_id), 0, "agent_start")

    def _submit_next(self, agent_id: int) -> None:
        turns, cursor = self._agents[agent_id]
        if cursor[0] >= len(turns):
            return
        spec = turns[cursor[0]]
        cursor[0] += 1
        now = self.loop.now
        rid = self._next_request_id
        self._next_request_id += 1
        req = Req(
            rid,
            agent_id,
            spec.turn_index,
            spec.prompt_tokens,
            spec.hit_tokens,
            spec.output_tokens,
            now,
        )
        self.reqs[rid] = req
        self.policy.submit(
            RequestInfo(
                rid, spec.prompt_tokens, spec.hit_tokens, spec.output_tokens, now, agent_id
            ),
            now,
        )
        self.request_pull(capacity_freed=False)

    # ------------------------------------------------------------------ pulls (SPEC §7.1)
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
        self._pull_event = self.loop.at(when, self._pull, PULL_PRIORITY, "pull")

    def _pull(self) -> None:
        self._pull_event = None
        if not self.policy.num_waiting:
            return
        now = self.loop.now
        self._last_pull_s = now
        self.num_pulls += 1
        for a in self.policy.schedule(self.view(), now):
            self._assign(a)
        self._blocked = self.policy.num_waiting > 0

    def view(self) -> ClusterView:
        """What the engines report at a pull: seq_e, tok_e, free HBM; read_q per node.
        States are cached per engine and rebuilt only when a counter changed."""
        topo, seq, tok, keys, states = self.topo, self.seq, self.tok, self._keys, self._states
        where = self._where
        for e in topo.pe_ids:
            key = (seq[e], tok[e], 0)
            if keys[e] != key:
                keys[e] = key
                states[e] = EngineState(e, *where[e], _PE, *key)
        hbm, reserved = self.hbm_capacity_tokens, self.reserved
        for group in self.decode_groups:
            generated = group.generated_by_member()  # one look-up of the steps done by now
            for e, gen in zip(group.members, generated, strict=True):
                num = seq[e]
                tokens = tok[e] + gen if num else 0
                free = hbm - reserved[e]
                key = (num, tokens, free if free > 0 else 0)
                if keys[e] != key:
                    keys[e] = key
                    states[e] = EngineState(e, *where[e], _DE, *key)
        node_cache = self._node_cache
        nodes = []
        for n in self.node_ios:
            q, read = n.read_queue_tokens, n.bytes_read  # bytes of the reads started so far
            nid = n.node_id
            state = node_cache[nid]
            if state.read_queue_tokens != q or state.bytes_read != read:
                state = node_cache[nid] = NodeState(nid, topo.kind_of_node(nid), q, read)
            nodes.append(state)
        return ClusterView(tuple(states), tuple(nodes))

    # ------------------------------------------------------------------ lifecycle
    def _assign(self, a: Assign) -> None:
        req = self.reqs[a.request_id]
        now = self.loop.now
        req.scheduled_s = now
        req.pe, req.de, req.read_side = a.pe, a.de, a.read_side
        req.pe_read_tokens, req.de_read_tokens = a.pe_read_tokens, a.de_read_tokens
        prompt = req.prompt_tokens
        self.seq[a.pe] += 1
        self.tok[a.pe] += prompt
        self.seq[a.de] += 1
        self.tok[a.de] += prompt
        req.hbm_tokens = prompt + req.output_tokens
        self.reserved[a.de] += req.hbm_tokens
        kvpt, topo = self.kv_per_token, self.topo
        reads = [(topo.node_of(a.pe), a.pe_read_tokens), (topo.node_of(a.de), a.de_read_tokens)]
        reads = [(n, t) for n, t in reads if t > 0]
        if self.system.oracle or not reads:
            req.read_start_s = req.read_done_s = now
            self.prefill_group_of[a.pe].add_ready(req)
            return
        req.reads_left = len(reads)
        req.pe_buffer_bytes = a.pe_read_tokens * kvpt
        req.de_buffer_bytes += a.de_read_tokens * kvpt
        for node, tokens in reads:
            self.node_ios[node].enqueue(req, tokens, tokens * kvpt)

    def _on_read_done(self, req: Req, node: int) -> None:
        req.reads_left -= 1
        if req.reads_left == 0:
            req.read_done_s = self.loop.now
            self.prefill_group_of[req.pe].add_ready(req)

    def _on_prefill_done(self, req: Req) -> None:
        now = self.loop.now
        req.first_token_s = now
        pe, de = req.pe, req.de
        self.seq[pe] -= 1
        self.tok[pe] -= req.prompt_tokens
        if req.pe_buffer_bytes:
            self.node_ios[self.topo.node_of(pe)].release(req.pe_buffer_bytes)
        blk = self.block_tokens
        new_blocks = req.prompt_tokens // blk * blk - req.hit_tokens
        if new_blocks > 0 and self.sim.persistence:  # the turn's new prompt blocks
            self.writers[self.topo.node_of(de)].send(new_blocks * self.kv_per_token)
        self.request_pull()
        if req.output_tokens == 1:
            req.second_token_s = req.finish_s = now
            self._release_de_buffer(req)
            self._finish(req)
            return
        self.h2d[de].send(req.prompt_tokens * self.kv_per_token, req)

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
        """The last token is out (``req.finish_s`` set): free the DE, record, next turn."""
        de = req.de
        self.seq[de] -= 1
        self.tok[de] -= req.prompt_tokens
        self.reserved[de] -= req.hbm_tokens
        blk = self.block_tokens
        context = req.prompt_tokens + req.output_tokens
        filled = (context - 1) // blk * blk - req.prompt_tokens // blk * blk
        if filled > 0 and self.sim.persistence:  # blocks filled during decode
            self.writers[self.topo.node_of(de)].send(filled * self.kv_per_token)
        self.records.append(_record(req))
        del self.reqs[req.request_id]
        self.num_turns_done += 1
        self.request_pull()
        self._submit_next(req.agent_id)


def _record(req: Req) -> TurnRecord:
    side = req.read_side.value if isinstance(req.read_side, ReadSide) else str(req.read_side)
    return TurnRecord(
        agent_id=req.agent_id,
        turn_index=req.turn_index,
        request_id=req.request_id,
        arrival_s=req.arrival_s,
        scheduled_s=req.scheduled_s,
        read_start_s=req.read_start_s,
        read_done_s=req.read_done_s,
        prefill_start_s=req.prefill_start_s,
        first_token_s=req.first_token_s,
        second_token_s=req.second_token_s,
        finish_s=req.finish_s,
        prompt_tokens=req.prompt_tokens,
        hit_tokens=req.hit_tokens,
        output_tokens=req.output_tokens,
        read_side=side,
    )


def _kind(topo: Topology, engine: int) -> EngineKind:
    return _PE if topo.is_pe(engine) else _DE
