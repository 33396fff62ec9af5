"""One round's working copies of the engines' counters (design §7.1), built from a checked view.

``ViewIndex.refresh`` is the one place a view is checked (its ``EngineState`` /
``NodeState`` objects check nothing when built): whole before anything is mutated, or only
where it changed since the last view that passed. Across rounds the shell's view is
authoritative and these copies are rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress

from dualpath.policy.view import ClusterView, EngineState, NodeState
from dualpath.policy.view_checks import changed, check_holds, node_counts_ok, validate_view
from dualpath.types import EngineKind


class ViewIndex:
    """The numbers of the last view that passed validation, kept across rounds.

    Shells rebuild only the ``EngineState`` / ``NodeState`` objects whose numbers changed
    (``dualpath.ledger``). A plain ``ClusterView`` whose states sit at the same indices with
    the same ids, kinds, nodes and groups as the last one is checked and indexed only where
    its state objects differ (O(changed) Python work, plus one identity scan); anything else is
    validated in full and indexed from scratch. A view that fails leaves the index unchanged.

    ``tok`` / ``seq``: tok_e / seq_e (for a DE of a view with ``generated``: without the
    generated tokens, which are in ``generated``); ``free``: DE free HBM tokens; ``node``:
    engine → node; ``read_q`` / ``read_bytes``: per node. Group member lists are sorted by
    engine id; ``pe_group_ids`` / ``de_group_ids`` are sorted group ids; ``all_pes``: every
    PE, sorted. ``de_group_of``: DE → group; ``de_tok_sum`` / ``de_free_sum``: Σ tok_e
    (generated tokens included) / Σ free HBM over each DE group's members, kept up to date
    with the per-engine and per-group numbers (exact: ints); ``generated``: the view's
    per-group tuples (``()``: none), one per ``de_group_ids`` entry. A group whose tuple is
    the same object as last time costs nothing, so a pull after some decode groups stepped
    costs O(those groups). All read-only outside this class.
    """

    __slots__ = (
        "_de_pos",
        "_engines",
        "_gen_sum",
        "_idle",
        "_kinds",
        "_nodes",
        "all_pes",
        "de_free_sum",
        "de_group_ids",
        "de_group_of",
        "de_groups",
        "de_tok_sum",
        "free",
        "generated",
        "node",
        "pe_group_ids",
        "pe_groups",
        "read_bytes",
        "read_q",
        "seq",
        "tok",
    )

    def __init__(self) -> None:
        self._engines: tuple[EngineState, ...] = ()
        self._nodes: tuple[NodeState, ...] = ()
        self._kinds: dict[int, EngineKind] = {}
        self.tok: dict[int, int] = {}
        self.seq: dict[int, int] = {}
        self.free: dict[int, int] = {}
        self.node: dict[int, int] = {}
        self.read_q: dict[int, int] = {}
        self.read_bytes: dict[int, float] = {}
        self.pe_groups: dict[int, list[int]] = {}
        self.de_groups: dict[int, list[int]] = {}
        self.pe_group_ids: list[int] = []
        self.de_group_ids: list[int] = []
        self.all_pes: list[int] = []
        self.de_group_of: dict[int, int] = {}
        self.de_tok_sum: dict[int, int] = {}
        self.de_free_sum: dict[int, int] = {}
        self.generated: tuple[tuple[int, ...], ...] = ()
        self._gen_sum: list[int] = []  # Σ of each ``generated`` tuple
        self._de_pos: dict[int, tuple[int, int]] = {}  # DE → (its group's place, its place)
        self._idle: list[list[bool]] = []  # per DE group, per member: seq_e == 0

    def refresh(
        self,
        view: ClusterView,
        held_pes: Mapping[int, int],
        queued_de_groups: Mapping[int, int],
    ) -> None:
        """Check ``view`` (``ValueError`` naming the first inconsistency) and index it."""
        delta = self._delta(view)
        if delta is None:
            validate_view(view, held_pes, queued_de_groups)
            self._index_all(view)
            return
        engines, nodes, groups = delta
        check_holds(self._kinds, set(self.de_groups), held_pes, queued_de_groups)
        tok, seq, free, de = self.tok, self.seq, self.free, EngineKind.DE
        group_of, tok_sum, free_sum = self.de_group_of, self.de_tok_sum, self.de_free_sum
        where, idle = self._de_pos, self._idle
        for e in engines:
            eid = e.engine_id
            t = e.tokens
            if e.kind is de:
                g = group_of[eid]
                tok_sum[g] += t - tok[eid]
                f = e.free_hbm_tokens
                free_sum[g] += f - free[eid]
                free[eid] = f
                i, j = where[eid]
                idle[i][j] = not e.seq
            tok[eid] = t
            seq[eid] = e.seq
        for n in nodes:
            self.read_q[n.node_id] = n.read_queue_tokens
            self.read_bytes[n.node_id] = n.bytes_read
        gen_sum, gids = self._gen_sum, self.de_group_ids
        for i, total in groups:
            g = gids[i]
            tok_sum[g] += total - gen_sum[i]
            gen_sum[i] = total
        self._engines, self._nodes, self.generated = view.engines, view.nodes, view.generated

    def _delta(
        self, view: ClusterView
    ) -> tuple[list[EngineState], list[NodeState], list[tuple[int, int]]] | None:
        """The states of ``view`` that differ from the last view's, checked, and the DE
        groups whose ``generated`` tuple is new, as (position, sum); None when the view must
        be validated in full (another shape, a changed id / kind / node / group, a bad count,
        or not a plain ``ClusterView``)."""
        old_engines, old_nodes = self._engines, self._nodes
        if type(view) is not ClusterView or not old_engines:
            return None
        same_gen = view.generated is self.generated
        if view.engines is old_engines and view.nodes is old_nodes and same_gen:
            return [], [], []  # the same objects as last time: nothing to check
        if len(view.engines) != len(old_engines) or len(view.nodes) != len(old_nodes):
            return None
        nodes: list[NodeState] = []
        for i in changed(view.nodes, old_nodes):
            n, old_n = view.nodes[i], old_nodes[i]
            if not (
                isinstance(n, NodeState)
                and (n.node_id, n.kind) == (old_n.node_id, old_n.kind)
                and node_counts_ok(n)
            ):
                return None
            nodes.append(n)
        engines: list[EngineState] = []
        int_, new_engines = int, view.engines
        for i in changed(new_engines, old_engines):
            e, o = new_engines[i], old_engines[i]
            if not (  # validate_view's engine rules inlined: this runs for every changed engine of every
                # pull; a state that breaks one goes to the full check, which names it
                type(e) is EngineState
                and e.engine_id == o.engine_id
                and e.node_id == o.node_id
                and e.group_id == o.group_id
                and e.kind is o.kind
                and type(e.seq) is int_
                and e.seq >= 0
                and type(e.tokens) is int_
                and e.tokens >= 0
                and (e.seq or not e.tokens)
                and type(e.free_hbm_tokens) is int_
                and e.free_hbm_tokens >= 0
            ):
                return None
            engines.append(e)
        groups: list[tuple[int, int]] = []
        generated = view.generated
        if not same_gen:
            new_groups = self._generated_delta(generated)
            if new_groups is None:
                return None
            groups = new_groups
        if generated and engines:  # a DE left without turns in this view generated nothing
            where = self._de_pos
            for e in engines:
                at = where.get(e.engine_id) if not e.seq else None
                if at is not None and generated[at[0]][at[1]]:
                    return None
        return engines, nodes, groups

    def _generated_delta(
        self, generated: tuple[tuple[int, ...], ...]
    ) -> list[tuple[int, int]] | None:
        """(position, sum) of each group tuple that differs from the last view's, checked
        (lengths, counts ≥ 0, and no tokens generated on a DE that had no turns); None when
        the whole view must be validated."""
        old = self.generated
        if type(generated) is not tuple or len(generated) != len(old):
            return None
        groups, gids, idle = self.de_groups, self.de_group_ids, self._idle
        out: list[tuple[int, int]] = []
        for i in changed(generated, old):
            values, members = generated[i], groups[gids[i]]
            if type(values) is not tuple or len(values) != len(members):
                return None
            if not values:
                out.append((i, 0))
                continue
            total = sum(values)  # in C; an int only if every value is one
            # (C again) tokens generated on a DE that had no turns in the last view: let the
            # full validation judge it with this view's seq_e
            if type(total) is not int or min(values) < 0 or any(compress(values, idle[i])):
                return None
            out.append((i, total))
        return out

    def _index_all(self, view: ClusterView) -> None:
        tok: dict[int, int] = {}
        seq: dict[int, int] = {}
        free: dict[int, int] = {}
        node: dict[int, int] = {}
        kinds: dict[int, EngineKind] = {}
        pe_groups: dict[int, list[int]] = {}
        de_groups: dict[int, list[int]] = {}
        pe = EngineKind.PE
        for e in view.engines:
            eid = e.engine_id
            tok[eid] = e.tokens
            seq[eid] = e.seq
            node[eid] = e.node_id
            kinds[eid] = e.kind
            if e.kind is pe:
                pe_groups.setdefault(e.group_id, []).append(eid)
            else:
                free[eid] = e.free_hbm_tokens
                de_groups.setdefault(e.group_id, []).append(eid)
        self.tok, self.seq, self.free, self.node, self._kinds = tok, seq, free, node, kinds
        self.read_q = {n.node_id: n.read_queue_tokens for n in view.nodes}
        self.read_bytes = {n.node_id: n.bytes_read for n in view.nodes}
        self.pe_groups, self.de_groups = pe_groups, de_groups
        self.pe_group_ids, self.de_group_ids = sorted(pe_groups), sorted(de_groups)
        self.all_pes = sorted(e for members in pe_groups.values() for e in members)
        self.de_group_of = {e: g for g, members in de_groups.items() for e in members}
        self.de_tok_sum = {g: sum(tok[e] for e in members) for g, members in de_groups.items()}
        self.de_free_sum = {g: sum(free[e] for e in members) for g, members in de_groups.items()}
        self.generated = view.generated
        self._gen_sum = [sum(values) for values in view.generated]
        members = [de_groups[g] for g in self.de_group_ids]
        self._de_pos = {e: (i, j) for i, des in enumerate(members) for j, e in enumerate(des)}
        self._idle = [[not seq[e] for e in des] for des in members]
        for g, total in zip(self.de_group_ids, self._gen_sum, strict=False):
            self.de_tok_sum[g] += total
        plain = type(view) is ClusterView  # only plain views are reused (see _delta)
        self._engines = view.engines if plain else ()
        self._nodes = view.nodes if plain else ()


class RoundState:
    """One round's working copies of the indexed counters (the rules mutate ``tok``, ``seq``,
    ``free`` and ``read_q`` as they place requests; a DE placement goes through ``take_de``,
    which keeps the group sums); PEs include the requests the policy holds for them. ``node``,
    the group lists, ``all_pes`` and ``read_bytes`` are the index's own (read-only).

    A DE's ``tok`` is its whole tok_e only once its group is opened (``open_de_group``, or
    ``open_de_groups`` for all): the tokens its turns generated are added then, so that a
    round pays for the groups whose members it looks at, not for every DE. Group sums
    (``de_tok_sum``) are whole from the start."""

    __slots__ = (
        "_generated",
        "_opened",
        "all_pes",
        "de_free_sum",
        "de_group_ids",
        "de_group_of",
        "de_groups",
        "de_tok_sum",
        "free",
        "node",
        "pe_group_ids",
        "pe_groups",
        "read_bytes",
        "read_q",
        "seq",
        "tok",
    )

    def __init__(self, index: ViewIndex, pe_holds: Mapping[int, tuple[int, int]]) -> None:
        self.tok = tok = index.tok.copy()
        self.seq = seq = index.seq.copy()
        self.free = index.free.copy()
        self.read_q = index.read_q.copy()
        self.de_tok_sum = index.de_tok_sum.copy()
        self.de_free_sum = index.de_free_sum.copy()
        self.node = index.node
        self.read_bytes = index.read_bytes
        self.pe_groups = index.pe_groups
        self.de_groups = index.de_groups
        self.pe_group_ids = index.pe_group_ids
        self.de_group_ids = index.de_group_ids
        self.all_pes = index.all_pes
        self.de_group_of = index.de_group_of
        for held, (tokens, count) in pe_holds.items():
            tok[held] += tokens
            seq[held] += count
        self._generated = dict(zip(index.de_group_ids, index.generated, strict=False))
        self._opened: set[int] = set()

    def open_de_group(self, gid: int) -> None:
        """Make ``tok`` of DE group ``gid``'s members whole (add what they generated)."""
        if gid in self._opened:
            return
        self._opened.add(gid)
        values = self._generated.get(gid)
        if values:
            tok = self.tok
            for e, g in zip(self.de_groups[gid], values, strict=True):
                if g:
                    tok[e] += g

    def open_de_groups(self) -> None:
        """``open_de_group`` for every DE group."""
        for gid in self.de_group_ids:
            self.open_de_group(gid)

    def take_de(self, de: int, tokens: int) -> None:
        """A request of ``tokens`` HBM tokens is placed on ``de``: tok_e and seq_e grow, free
        HBM shrinks, in the engine's numbers and its group's sums."""
        self.tok[de] += tokens
        self.seq[de] += 1
        self.free[de] -= tokens
        g = self.de_group_of[de]
        self.de_tok_sum[g] += tokens
        self.de_free_sum[g] -= tokens

    def credit_de(self, de: int, tokens: int) -> None:
        """``tokens`` of ``de``'s HBM that counted as taken are the placed request's own
        (blocks a reuse design held for it): its free HBM grows back by them."""
        self.free[de] += tokens
        self.de_free_sum[self.de_group_of[de]] += tokens
