"""The load counters of SPEC §13.4 and the ``ClusterView`` the policy pulls, kept incrementally.

A shell reports what happened to a turn (submitted, assigned, read started / done, first
token, finished); the ledger moves the turn's phase, keeps seq_e / tok_e / reserved HBM per
engine and read_q / bytes read per node, and emits the matching event. A pull rebuilds only
the ``EngineState`` / ``NodeState`` objects whose counters changed since the last pull.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dualpath.ledger.events import Assigned, EventBus, FirstToken, ReadDone, Submitted, TurnDone
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import Phase, Turn
from dualpath.metrics import TurnRecord
from dualpath.policy import Assign, ClusterView, EngineState, NodeState, RequestInfo
from dualpath.types import EngineKind
from dualpath.workload import persisted_tokens

# a DE group's tokens generated so far per member (in member order), e.g. from its decode batch
GeneratedFn = Callable[[], Sequence[int]]


def prompt_block_tokens(turn: Turn, block_tokens: int) -> int:
    """Tokens of the whole prompt blocks the turn's prefill computed (to persist, SPEC §3)."""
    return turn.prompt_tokens // block_tokens * block_tokens - turn.hit_tokens


def decode_block_tokens(turn: Turn, block_tokens: int) -> int:
    """Tokens of the blocks filled during decode (to persist when the turn finishes): the
    next turn's hits are ``persisted_tokens(prompt + output)``."""
    context = turn.prompt_tokens + turn.output_tokens
    return (
        persisted_tokens(context, block_tokens) - turn.prompt_tokens // block_tokens * block_tokens
    )


class Ledger:
    """Counters and turn phases of one cluster (``topology``).

    ``hbm_capacity_tokens``: KV tokens one DE's HBM holds (its share of the weights spread
    over its EP group, ``Topology.decode_ep_gpus``); a DE's free HBM = capacity − tokens
    reserved by the turns assigned to it. tok_e of a DE = prompts of its turns + the tokens
    they generated so far (SPEC §13.4), from the ``GeneratedFn`` of its group.
    """

    def __init__(
        self,
        topology: Topology,
        hbm_capacity_tokens: int,
        block_tokens: int,
        events: EventBus | None = None,
    ) -> None:
        self.topology = topo = topology
        self.hbm_capacity_tokens = hbm_capacity_tokens
        self.block_tokens = block_tokens
        self.events = events if events is not None else EventBus()
        num_engines, num_nodes = len(topo.engine_ids), topo.num_nodes
        self.seq = [0] * num_engines  # seq_e: turns assigned and not yet done with the engine
        self.tok = [0] * num_engines  # Σ prompt tokens of those turns (DEs: + generated)
        self.reserved = [0] * num_engines  # DE HBM reserved, tokens
        self.read_q = [0] * num_nodes  # hit tokens queued or being read from storage
        self.bytes_read = [0.0] * num_nodes  # bytes of the storage reads started so far
        self.num_done = 0
        self._node_of = [topo.node_of(e) for e in topo.engine_ids]
        self._engines = [
            EngineState(e, topo.node_of(e), topo.group_of(e), topo.kind_of(e))
            for e in topo.engine_ids
        ]
        self._nodes = [NodeState(n, topo.kind_of_node(n)) for n in range(num_nodes)]
        self._dirty_engines: set[int] = set(topo.engine_ids)  # DEs start with free HBM
        self._dirty_nodes: set[int] = set()
        self._decode_groups: list[tuple[tuple[int, ...], GeneratedFn, list[int]]] = []
        self._generated = [0] * num_engines  # DEs: tokens generated, as of the last pull
        self._view: ClusterView | None = None

    def track_decode(self, members: tuple[int, ...], generated: GeneratedFn) -> None:
        """``generated()`` reports the tokens generated so far by each member's turns."""
        self._decode_groups.append((members, generated, [0] * len(members)))

    # ------------------------------------------------------------------ a turn's life
    def submit(self, turn: Turn, now: float) -> RequestInfo:
        """The turn arrived; returns what the policy is to be given."""
        if self.events.wants(Submitted):
            self.events.emit(Submitted(now, turn))
        return turn.info()

    def assign(self, turn: Turn, a: Assign, now: float, read: bool = True) -> list[tuple[int, int]]:
        """The policy's ``Assign`` for ``turn``: counts it on its PE and DE and returns the
        storage reads to start, ``(node, hit tokens)`` each (counted in that node's read_q).
        With ``read=False`` (the Oracle) or nothing to read, the turn's reads are done now."""
        turn.scheduled_s = now
        turn.pe, turn.de, turn.read_side = a.pe, a.de, a.read_side
        turn.pe_read_tokens, turn.de_read_tokens = a.pe_read_tokens, a.de_read_tokens
        prompt = turn.prompt_tokens
        seq, tok, dirty = self.seq, self.tok, self._dirty_engines
        seq[a.pe] += 1
        tok[a.pe] += prompt
        seq[a.de] += 1
        tok[a.de] += prompt
        self.reserved[a.de] += turn.hbm_tokens
        dirty.add(a.pe)
        dirty.add(a.de)
        node_of = self._node_of
        reads = [(node_of[a.pe], a.pe_read_tokens), (node_of[a.de], a.de_read_tokens)]
        reads = [(n, t) for n, t in reads if t > 0] if read else []
        if self.events.wants(Assigned):
            self.events.emit(Assigned(now, turn))
        if not reads:
            turn.read_start_s = now
            self._reads_done(turn, now)
            return reads
        turn.phase = Phase.READING
        turn.reads_left = len(reads)
        for node, tokens in reads:
            self.read_q[node] += tokens
            self._dirty_nodes.add(node)
        return reads

    def read_started(self, turn: Turn, node: int, num_bytes: float, now: float) -> None:
        """A storage read of ``num_bytes`` for ``turn`` started on ``node``."""
        if turn.read_start_s < 0:
            turn.read_start_s = now
        self.bytes_read[node] += num_bytes
        self._dirty_nodes.add(node)

    def read_done(self, turn: Turn, node: int, now: float) -> bool:
        """The turn's read on ``node`` finished; True when it was its last."""
        tokens = turn.pe_read_tokens if node == self._node_of[turn.pe] else turn.de_read_tokens
        self.read_q[node] -= tokens
        self._dirty_nodes.add(node)
        turn.reads_left -= 1
        if turn.reads_left:
            return False
        self._reads_done(turn, now)
        return True

    def _reads_done(self, turn: Turn, now: float) -> None:
        turn.read_done_s = now
        turn.phase = Phase.PREFILLING
        if self.events.wants(ReadDone):
            self.events.emit(ReadDone(now, turn))

    def first_token(self, turn: Turn, now: float) -> None:
        """Prefill is done: the turn leaves its PE (token 1 is out) and decodes on its DE."""
        turn.first_token_s = now
        turn.phase = Phase.DECODING
        pe = turn.pe
        self.seq[pe] -= 1
        self.tok[pe] -= turn.prompt_tokens
        self._dirty_engines.add(pe)
        if self.events.wants(FirstToken):
            self.events.emit(FirstToken(now, turn))

    def finish(self, turn: Turn, now: float) -> TurnRecord:
        """The last token is out (``turn.finish_s`` and ``second_token_s`` stamped): the turn
        leaves its DE; returns its record."""
        de = turn.de
        self.seq[de] -= 1
        self.tok[de] -= turn.prompt_tokens
        self.reserved[de] -= turn.hbm_tokens
        self._dirty_engines.add(de)
        turn.phase = Phase.DONE
        self.num_done += 1
        record = turn.record()
        if self.events.wants(TurnDone):
            self.events.emit(TurnDone(now, turn, record))
        return record

    # ------------------------------------------------------------------ the policy's view
    def view(self) -> ClusterView:
        """What the engines report at a pull (SPEC §7.1): seq_e, tok_e, free HBM; read_q and
        bytes read per node. Costs O(engines and nodes whose numbers changed) plus one
        comparison per DE group; unchanged states are the very same objects as before, and
        when nothing changed the view is the very same object."""
        states, seq, tok = self._engines, self.seq, self.tok
        dirty = self._dirty_engines
        generated = self._generated
        for members, report, last in self._decode_groups:
            now_gen = report()
            if now_gen == last:  # the group did not step since the last pull
                continue
            for e, g, before in zip(members, now_gen, last, strict=True):
                if g != before:
                    generated[e] = g
                    dirty.add(e)
            last[:] = now_gen
        changed = False
        if dirty:
            capacity, reserved = self.hbm_capacity_tokens, self.reserved
            pe = EngineKind.PE
            for e in dirty:
                old = states[e]
                num = seq[e]
                if old.kind is pe:
                    t = tok[e]
                    if num != old.seq or t != old.tokens:
                        states[e] = EngineState(e, old.node_id, old.group_id, pe, num, t)
                        changed = True
                    continue
                tokens = tok[e] + generated[e] if num else 0
                free = capacity - reserved[e]
                if free < 0:
                    free = 0
                if num != old.seq or tokens != old.tokens or free != old.free_hbm_tokens:
                    states[e] = EngineState(
                        e, old.node_id, old.group_id, old.kind, num, tokens, free
                    )
                    changed = True
            dirty.clear()
        nodes = self._nodes
        if self._dirty_nodes:
            read_q, read = self.read_q, self.bytes_read
            for n in self._dirty_nodes:
                old_node = nodes[n]
                nodes[n] = NodeState(n, old_node.kind, read_q[n], read[n])
            self._dirty_nodes.clear()
            changed = True
        if changed or self._view is None:
            self._view = ClusterView(tuple(states), tuple(nodes))
        return self._view
