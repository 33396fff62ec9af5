"""One round's working copies of the engines' counters (SPEC §7.1), built from a checked view.

The view is validated whole before anything is mutated; across rounds the shell's view is
authoritative and these copies are rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dualpath.policy.view import ClusterView, EngineState, NodeState
from dualpath.types import EngineKind


class RoundState:
    """Mutable per-round counters keyed by engine / node id.

    ``tok``/``seq``: tok_e / seq_e (PEs include the requests the policy holds for them);
    ``free``: DE free HBM tokens; ``read_q``: node read queue tokens; ``read_bytes``: bytes
    each node's storage NICs have read (for the ``least_read`` tie-break). Group member lists are
    sorted by engine id; ``pe_group_ids`` / ``de_group_ids`` are sorted group ids.
    """

    __slots__ = (
        "de_group_ids",
        "de_groups",
        "free",
        "node",
        "pe_group_ids",
        "pe_groups",
        "read_bytes",
        "read_q",
        "seq",
        "tok",
    )

    def __init__(self, view: ClusterView, pe_holds: Mapping[int, tuple[int, int]]) -> None:
        self.tok: dict[int, int] = {}
        self.seq: dict[int, int] = {}
        self.free: dict[int, int] = {}
        self.node: dict[int, int] = {}
        self.read_q: dict[int, int] = {n.node_id: n.read_queue_tokens for n in view.nodes}
        self.read_bytes: dict[int, float] = {n.node_id: n.bytes_read for n in view.nodes}
        pe_groups: dict[int, list[int]] = {}
        de_groups: dict[int, list[int]] = {}
        tok, seq, free, node, pe = self.tok, self.seq, self.free, self.node, EngineKind.PE
        for e in view.engines:
            eid = e.engine_id
            tok[eid] = e.tokens
            seq[eid] = e.seq
            node[eid] = e.node_id
            if e.kind is pe:
                pe_groups.setdefault(e.group_id, []).append(eid)
            else:
                free[eid] = e.free_hbm_tokens
                de_groups.setdefault(e.group_id, []).append(eid)
        for held, (tokens, count) in pe_holds.items():
            tok[held] += tokens
            seq[held] += count
        self.pe_group_ids = sorted(pe_groups)
        self.de_group_ids = sorted(de_groups)
        self.pe_groups = pe_groups
        self.de_groups = de_groups


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_view(
    view: ClusterView,
    held_pes: Mapping[int, int],
    queued_de_groups: Mapping[int, int],
    checked: Sequence[EngineState] = (),
) -> None:
    """Raise ``ValueError`` naming the first inconsistency; mutate nothing.

    ``held_pes``: PE id → requests the policy holds for it (must still be a PE in the view);
    ``queued_de_groups``: DE group id → requests in its private queue (group must exist).
    ``checked``: the engines of an earlier view that passed against nodes of the same ids and
    kinds; an engine that is the very same (immutable) object at the same index is not
    checked field by field again, only for id order.
    """
    if not isinstance(view, ClusterView):
        raise ValueError(f"view must be a ClusterView, got {type(view).__name__}")
    nodes: dict[int, NodeState] = {}
    last = -1
    for n in view.nodes:
        if not isinstance(n, NodeState) or not _is_count(n.node_id):
            raise ValueError(f"view.nodes: {n!r} is not a NodeState with an integer id >= 0")
        if n.node_id <= last:
            raise ValueError(f"view.nodes: node ids must be unique and sorted, got {n.node_id}")
        last = n.node_id
        nodes[n.node_id] = n
    de_group_ids: set[int] = set()
    last = -1
    kinds: dict[int, EngineKind] = {}
    de = EngineKind.DE
    num_checked = len(checked)
    for i, e in enumerate(view.engines):
        if i < num_checked and e is checked[i]:
            if e.engine_id <= last:
                raise ValueError(
                    f"view.engines: engine ids must be unique and sorted, got {e.engine_id}"
                )
        else:
            _check_engine(e, last, nodes)
        last = e.engine_id
        kind = e.kind
        kinds[last] = kind
        if kind is de:
            de_group_ids.add(e.group_id)
    for pe, count in sorted(held_pes.items()):
        if count and kinds.get(pe) is not EngineKind.PE:
            raise ValueError(
                f"view: PE {pe} holds {count} request(s) waiting for a DE but is not a PE "
                "in this view"
            )
    for gid, count in sorted(queued_de_groups.items()):
        if count and gid not in de_group_ids:
            raise ValueError(
                f"view: DE group {gid} has {count} request(s) in its private queue but no "
                "engine in this view"
            )


def _check_engine(e: EngineState, last: int, nodes: Mapping[int, NodeState]) -> None:
    if not isinstance(e, EngineState):
        raise ValueError(f"view.engines: {e!r} is not an EngineState")
    eid, nid, gid = e.engine_id, e.node_id, e.group_id
    seq, tokens, free = e.seq, e.tokens, e.free_hbm_tokens
    int_ = int
    if not (  # fast path: plain ints >= 0 pass; anything else is checked field by field
        type(eid) is int_
        and eid >= 0
        and type(nid) is int_
        and nid >= 0
        and type(gid) is int_
        and gid >= 0
        and type(seq) is int_
        and seq >= 0
        and type(tokens) is int_
        and tokens >= 0
        and type(free) is int_
        and free >= 0
    ):
        _check_counts(e)
    if eid <= last:
        raise ValueError(f"view.engines: engine ids must be unique and sorted, got {eid}")
    node = nodes.get(nid)
    if node is None:
        raise ValueError(f"engine {eid}: node_id={nid} is not in view.nodes")
    if node.kind is not e.kind:
        raise ValueError(
            f"engine {eid}: kind={e.kind.value} on node {nid} of kind "
            f"{node.kind.value}: engine and node kinds must match"
        )


def _check_counts(e: EngineState) -> None:
    for name in ("engine_id", "node_id", "group_id", "seq", "tokens", "free_hbm_tokens"):
        value = getattr(e, name)
        if not _is_count(value):
            raise ValueError(
                f"engine {e.engine_id}: {name}={value!r} is invalid: must be an integer >= 0"
            )
