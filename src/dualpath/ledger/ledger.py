"""The load counters of design §13.4 and the ``ClusterView`` the policy pulls, kept incrementally.

A shell reports what happened to a turn (submitted, assigned, read started / done, a pass
started / a chunk done, first token, loaded into DE HBM, finished, aborted); the ledger moves
the turn through its lifecycle (``lifecycle.advance``: a report out of order is refused), keeps seq_e
/ tok_e / reserved HBM per engine and read_q / bytes read per node, and emits the matching
event. A pull rebuilds only the ``EngineState`` / ``NodeState`` objects whose counters
changed since the last pull.

Free HBM has two sources. The simulator reports none: a DE's free HBM is its capacity minus
the tokens reserved by the turns assigned to it, until they finish. The runtime's engines
report their real free pool (``report_free_hbm``); a turn's reservation then ends when its DE
admitted it (``loaded``), after which the engine's report counts it.

Each input (and each pull's view and decisions, each forward plan) is also emitted as an
event, when someone subscribed: with a journal (``start_journal``: a ``ledger.journal``
subscriber) every one is written as a JSON-able record, so that ``dualpath.ledger.replay``
can feed the same inputs to a fresh ledger and policy and check that they decide the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dualpath.ledger.events import (
    Aborted,
    Assigned,
    ChunkDone,
    EventBus,
    FirstToken,
    FreeHbmReported,
    GeneratedCounted,
    Loaded,
    NodeReadDone,
    PassStarted,
    Planned,
    Pulled,
    ReadDone,
    ReadStarted,
    Submitted,
    TurnDone,
)
from dualpath.ledger.journal import Journal, JournalSink
from dualpath.ledger.lifecycle import LifecycleError, Phase, advance
from dualpath.ledger.topology import Topology
from dualpath.ledger.turn import Turn
from dualpath.metrics import TurnRecord
from dualpath.policy import Assign, ClusterView, EngineState, NodeState, RequestInfo
from dualpath.policy.base import PendingPrefill, Policy
from dualpath.policy.commands import ForwardBatch
from dualpath.types import EngineKind
from dualpath.workload import persisted_tokens

# a DE group's tokens generated so far per member (in member order), e.g. from its decode batch
GeneratedFn = Callable[[], Sequence[int]]
# a value that changes whenever a DE group's ``GeneratedFn`` may report something new
StampFn = Callable[[], object]


def prompt_block_tokens(turn: Turn, block_tokens: int) -> int:
    """Tokens of the whole prompt blocks the turn's prefill computed (to persist, design §3)."""
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
    reserved by the turns assigned to it (or, once an engine reported its free HBM with
    ``report_free_hbm``, that report minus the turns assigned and not yet ``loaded``). tok_e
    of a DE = prompts of its turns + the tokens they generated so far (design §13.4), from the
    ``GeneratedFn`` of its group.
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
        self.tok = [0] * num_engines  # Σ prompt tokens of those turns (not generated ones)
        self.reserved = [0] * num_engines  # DE HBM reserved, tokens
        # DE HBM held by a reuse design's pinned blocks (``pin``; the simulator's d2p)
        self.pinned = [0] * num_engines
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
        # per DE group: members, generated(), its values at the last pull, stamp(), its value,
        # its position in ``_generated``
        self._decode_groups: list[
            tuple[tuple[int, ...], GeneratedFn, list[int], StampFn | None, list[object], int]
        ] = []
        # per DE group in group id order: its members' generated tokens, as of the last pull
        # (the view's ``generated``); empty while no group is tracked
        self._generated: list[tuple[int, ...]] = []
        self._reported: list[int] | None = None  # free HBM tokens the engines reported; -1: none
        self._view: ClusterView | None = None
        self.journal: Journal | None = None  # with ``start_journal``

    def track_decode(
        self, members: tuple[int, ...], generated: GeneratedFn, stamp: StampFn | None = None
    ) -> None:
        """``generated()`` reports the tokens generated so far by each member's turns.
        ``stamp()``, if given, returns a value that changes whenever ``generated()`` may
        report something new: a pull skips the group while its stamp is unchanged (a group
        whose numbers moved pushes a new stamp instead of being compared member by member)."""
        topo = self.topology
        groups: dict[int, list[int]] = {}
        for e in topo.de_ids:
            groups.setdefault(topo.group_of(e), []).append(e)
        gids = sorted(groups)
        gid = topo.group_of(members[0]) if members else -1
        if gid not in groups or list(members) != groups[gid]:
            raise ValueError(
                f"track_decode: members {members} are not one whole DE group in engine id order"
            )
        if not self._generated:
            self._generated = [(0,) * len(groups[g]) for g in gids]
        pos = gids.index(gid)
        self._decode_groups.append((members, generated, [0] * len(members), stamp, [None], pos))
        self._view = None

    def report_free_hbm(self, engine: int, tokens: int) -> None:
        """Engine ``engine`` reports ``tokens`` of KV that fit in its free HBM (it counts the
        turns it admitted; those assigned and not yet ``loaded`` are still reserved here)."""
        reported = self._reported
        if reported is None:
            reported = self._reported = [-1] * len(self.topology.engine_ids)
        if reported[engine] != tokens:
            reported[engine] = tokens
            self._dirty_engines.add(engine)
        if self.events.wants(FreeHbmReported):
            self.events.emit(FreeHbmReported(engine, tokens))

    def start_journal(self, sink: JournalSink) -> None:
        """Write every input from now on to ``sink`` (before the first turn is submitted): an
        ``init`` record first, with the sizes, the DE groups tracked and the reports so far;
        then a ``Journal`` on the event bus writes one record per input."""
        if self.journal is not None:
            raise ValueError("the ledger already writes a journal")
        if any(self.seq) or any(self.read_q) or self.num_done:
            raise ValueError("start_journal must come before the first turn")
        sink(
            {
                "op": "init",
                "hbm_capacity_tokens": self.hbm_capacity_tokens,
                "block_tokens": self.block_tokens,
                "decode_groups": [list(g[0]) for g in self._decode_groups],
                "free_hbm": list(self._reported) if self._reported is not None else None,
            }
        )
        self.journal = Journal(sink)
        self.journal.subscribe(self.events)

    # ------------------------------------------------------------------ a turn's life
    def submit(self, turn: Turn, now: float) -> RequestInfo:
        """The turn arrived; returns what the policy is to be given."""
        if self.events.wants(Submitted):
            self.events.emit(Submitted(now, turn))
        return turn.info()

    def pull(self, policy: Policy, now: float) -> list[Assign]:
        """A pull (design §7.1): the policy schedules on the current view; returns its
        decisions for the shell to carry out (each then reported with ``assign``)."""
        view = self.view()
        assigns = policy.schedule(view, now)
        if self.events.wants(Pulled):
            self.events.emit(Pulled(now, view, tuple(assigns)))
        return assigns

    def plan(
        self,
        policy: Policy,
        pe: int,
        pending: Sequence[PendingPrefill],
        now: float,
        budget: int | None,
        cap_s: float | None = None,
    ) -> ForwardBatch:
        """PE ``pe``'s next forward pass over its ``pending`` queue (``policy.plan_forward``)."""
        batch = policy.plan_forward(pe, pending, now, budget, cap_s)
        if self.events.wants(Planned):
            self.events.emit(Planned(now, pe, tuple(pending), budget, cap_s, batch))
        return batch

    def plan_group(
        self,
        policy: Policy,
        queues: Mapping[int, tuple[Sequence[PendingPrefill], int | None]],
        now: float,
    ) -> list[tuple[int, ForwardBatch]]:
        """The next pass of an EP group: every PE with a queue (``queues``: PE → its pending
        queue and HBM budget) planned to the quota, then those above ``policy.balance_cap``
        of the predictions planned again under it. PEs in id order."""
        order = sorted(queues)
        plans = [self.plan(policy, pe, queues[pe][0], now, queues[pe][1]) for pe in order]
        cap = policy.balance_cap([b.predicted_attention_s for b in plans])
        if cap is not None:
            plans = [
                self.plan(policy, pe, queues[pe][0], now, queues[pe][1], cap)
                if b.predicted_attention_s > cap
                else b
                for pe, b in zip(order, plans, strict=True)
            ]
        return list(zip(order, plans, strict=True))

    def assign(self, turn: Turn, a: Assign, now: float, read: bool = True) -> list[tuple[int, int]]:
        """The policy's ``Assign`` for ``turn``: counts it on its PE and DE and returns the
        storage reads to start, ``(node, hit tokens)`` each (counted in that node's read_q).
        With ``read=False`` (the Oracle) or nothing to read, the turn's reads are done now."""
        advance(turn, Phase.SCHEDULED, "assign")
        turn.scheduled_s = now
        turn.pe, turn.de, turn.read_side = a.pe, a.de, a.read_side
        turn.pe_read_tokens, turn.de_read_tokens = a.pe_read_tokens, a.de_read_tokens
        if a.reuse_tokens or a.recompute_tokens or a.de_prefetch_tokens:
            turn.reuse_source, turn.reuse_node = a.reuse_source, a.reuse_node
            turn.reuse_engine = a.reuse_engine
            turn.reuse_tokens, turn.de_prefetch_tokens = a.reuse_tokens, a.de_prefetch_tokens
            turn.hit_tokens -= a.recompute_tokens  # computed again: no longer a hit
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
        de_tokens = a.de_read_tokens + a.de_prefetch_tokens
        reads = [(node_of[a.pe], a.pe_read_tokens), (node_of[a.de], de_tokens)]
        reads = [(n, t) for n, t in reads if t > 0] if read else []
        if self.events.wants(Assigned):
            self.events.emit(Assigned(now, turn, a, read))
        if not reads:
            turn.read_start_s = now
            self._reads_done(turn, now)
            return reads
        turn.reads_left = len(reads)
        for node, tokens in reads:
            self.read_q[node] += tokens
            self._dirty_nodes.add(node)
        return reads

    def pin(self, de: int, tokens: int) -> None:
        """``tokens`` of DE ``de``'s HBM are held by blocks no turn owns (a reuse design's,
        ``ledger.residency``): its free HBM counts them as taken."""
        if self.pinned[de] != tokens:
            self.pinned[de] = tokens
            self._dirty_engines.add(de)

    def read_started(self, turn: Turn, node: int, num_bytes: float, now: float) -> None:
        """A storage read of ``num_bytes`` for ``turn`` started on ``node``."""
        if turn.phase is not Phase.READING:
            advance(turn, Phase.READING, "read_started")
        if self.events.wants(ReadStarted):
            self.events.emit(ReadStarted(now, turn, node, num_bytes))
        if turn.read_start_s < 0:
            turn.read_start_s = now
        self.bytes_read[node] += num_bytes
        self._dirty_nodes.add(node)

    def read_done(self, turn: Turn, node: int, now: float) -> bool:
        """The turn's read on ``node`` finished; True when it was its last."""
        if turn.phase is not Phase.READING:
            raise LifecycleError(f"request {turn.request_id}: read_done while {turn.phase.value}")
        if self.events.wants(NodeReadDone):
            self.events.emit(NodeReadDone(now, turn, node))
        if node == self._node_of[turn.pe]:
            tokens = turn.pe_read_tokens
        else:
            tokens = turn.de_read_tokens + turn.de_prefetch_tokens
        self.read_q[node] -= tokens
        self._dirty_nodes.add(node)
        turn.reads_left -= 1
        if turn.reads_left:
            return False
        self._reads_done(turn, now)
        return True

    def _reads_done(self, turn: Turn, now: float) -> None:
        advance(turn, Phase.READY, "read_done")
        turn.read_done_s = now
        turn.kv_tokens = turn.hit_tokens  # what was read (a shell may lower it first)
        if self.events.wants(ReadDone):
            self.events.emit(ReadDone(now, turn))

    def pass_started(self, turn: Turn, now: float) -> None:
        """A chunk of the turn's prompt (after its ``kv_tokens``) went into a PE pass."""
        advance(turn, Phase.IN_PASS, "pass_started")
        if self.events.wants(PassStarted):
            self.events.emit(PassStarted(now, turn))

    def chunk_done(self, turn: Turn, new_tokens: int, now: float) -> None:
        """A chunk of ``new_tokens`` came out of its pass and more of the prompt is left: the
        turn is back in its PE's queue with that much more KV."""
        if turn.kv_tokens + new_tokens >= turn.prompt_tokens:
            raise LifecycleError(
                f"request {turn.request_id}: chunk_done of its last chunk (first_token ends it)"
            )
        advance(turn, Phase.READY, "chunk_done")
        turn.kv_tokens += new_tokens
        if self.events.wants(ChunkDone):
            self.events.emit(ChunkDone(now, turn, new_tokens))

    def first_token(self, turn: Turn, now: float) -> None:
        """Prefill is done (the last chunk's pass): the turn leaves its PE (token 1 is out)
        and decodes on its DE."""
        advance(turn, Phase.DECODING, "first_token")
        turn.kv_tokens = turn.prompt_tokens
        turn.first_token_s = now
        pe = turn.pe
        self.seq[pe] -= 1
        self.tok[pe] -= turn.prompt_tokens
        self._dirty_engines.add(pe)
        if self.events.wants(FirstToken):
            self.events.emit(FirstToken(now, turn))

    def finish(self, turn: Turn, now: float) -> TurnRecord:
        """The last token is out (``turn.finish_s`` and ``second_token_s`` stamped): the turn
        leaves its DE; returns its record."""
        advance(turn, Phase.DONE, "finish")
        self._leave_de(turn)
        self.num_done += 1
        record = turn.record()
        if self.events.wants(TurnDone):
            self.events.emit(TurnDone(now, turn, record))
        return record

    def loaded(self, turn: Turn, now: float) -> None:
        """The turn's DE admitted it: from now on the DE's reported free HBM counts it, so its
        reservation ends (only for engines that report free HBM)."""
        if turn.loaded or turn.phase is not Phase.DECODING:
            raise LifecycleError(
                f"request {turn.request_id}: loaded twice or while {turn.phase.value}"
            )
        turn.loaded = True
        self.reserved[turn.de] -= turn.hbm_tokens
        self._dirty_engines.add(turn.de)
        if self.events.wants(Loaded):
            self.events.emit(Loaded(now, turn))

    def abort(self, turn: Turn, now: float) -> None:
        """The turn is dropped before it finished: it leaves every counter it was in (its
        storage reads if they are still queued, its PE until token 1, its DE)."""
        phase = turn.phase
        if phase is Phase.QUEUED:
            raise LifecycleError(
                f"request {turn.request_id}: cannot abort a turn queued (the policy holds it: "
                "mark it cancelled)"
            )
        pe, de = turn.pe, turn.de
        if phase is Phase.SCHEDULED or phase is Phase.READING:
            de_tokens = turn.de_read_tokens + turn.de_prefetch_tokens
            reads = [(pe, turn.pe_read_tokens), (de, de_tokens)]
            reads = [(self._node_of[e], t) for e, t in reads if t > 0]
            if turn.reads_left != len(reads):
                raise LifecycleError(
                    f"request {turn.request_id}: cannot abort a turn with part of its reads done"
                )
            for node, tokens in reads:
                self.read_q[node] -= tokens
                self._dirty_nodes.add(node)
        on_pe = phase.on_pe
        advance(turn, Phase.ABORTED, "abort")
        if on_pe:
            self.seq[pe] -= 1
            self.tok[pe] -= turn.prompt_tokens
            self._dirty_engines.add(pe)
        self._leave_de(turn)
        if self.events.wants(Aborted):
            self.events.emit(Aborted(now, turn))

    def _leave_de(self, turn: Turn) -> None:
        de = turn.de
        self.seq[de] -= 1
        self.tok[de] -= turn.prompt_tokens
        if not turn.loaded:
            self.reserved[de] -= turn.hbm_tokens
        self._dirty_engines.add(de)

    # ------------------------------------------------------------------ the policy's view
    def view(self) -> ClusterView:
        """What the engines report at a pull (design §7.1): seq_e, tok_e, free HBM; read_q and
        bytes read per node. A DE's tok_e comes in two parts: its state's ``tokens`` (the
        prompts of its turns) and its group's ``generated`` tuple, which is all that changes
        when a group steps. Costs O(engines and nodes whose numbers changed + DE groups that
        stepped); unchanged states and tuples are the very same objects as before, and when
        nothing changed the view is the very same object."""
        states, seq, tok = self._engines, self.seq, self.tok
        dirty = self._dirty_engines
        generated = self._generated
        stepped = changed = False  # a group's tuple / an engine state is new
        for members, report, last, stamp, seen, pos in self._decode_groups:
            if stamp is not None:
                mark = stamp()
                if mark == seen[0]:
                    continue
                seen[0] = mark
            now_gen = report()
            if now_gen == last:  # the group did not step since the last pull
                continue
            last[:] = now_gen
            generated[pos] = tuple(now_gen)
            stepped = True
            if self.events.wants(GeneratedCounted):
                self.events.emit(GeneratedCounted(members, generated[pos]))
        if dirty:
            capacity, reserved, reported = self.hbm_capacity_tokens, self.reserved, self._reported
            pe = EngineKind.PE
            for e in dirty:
                old = states[e]
                num = seq[e]
                if old.kind is pe:
                    t = tok[e]
                    # a PE's free HBM is its own pool's report (runtime) or 0 (simulator)
                    pe_free = reported[e] if reported is not None and reported[e] >= 0 else 0
                    if num != old.seq or t != old.tokens or pe_free != old.free_hbm_tokens:
                        states[e] = EngineState(e, old.node_id, old.group_id, pe, num, t, pe_free)
                        changed = True
                    continue
                tokens = tok[e]
                if reported is not None and reported[e] >= 0:
                    free = reported[e] - reserved[e]
                else:
                    free = capacity - reserved[e] - self.pinned[e]
                if free < 0:
                    free = 0
                if num != old.seq or tokens != old.tokens or free != old.free_hbm_tokens:
                    states[e] = EngineState(
                        e, old.node_id, old.group_id, old.kind, num, tokens, free
                    )
                    changed = True
            dirty.clear()
        view = self._view
        if view is None:
            view = ClusterView(tuple(states), self._node_states(), tuple(generated))
        elif changed or stepped or self._dirty_nodes:  # keep every unchanged tuple
            view = ClusterView(
                tuple(states) if changed else view.engines,
                self._node_states() if self._dirty_nodes else view.nodes,
                tuple(generated) if stepped else view.generated,
            )
        self._view = view
        return view

    def _node_states(self) -> tuple[NodeState, ...]:
        nodes, read_q, read = self._nodes, self.read_q, self.bytes_read
        for n in self._dirty_nodes:
            nodes[n] = NodeState(n, nodes[n].kind, read_q[n], read[n])
        self._dirty_nodes.clear()
        return tuple(nodes)
