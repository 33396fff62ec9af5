"""The checks of a view the policy pulls (``view.ClusterView``), beside the view's types.

``ViewIndex.refresh`` (``state``) calls ``validate_view`` on a view it cannot index by its
changes alone, and ``check_holds`` / ``node_counts_ok`` / ``changed`` on one it can: a bad
state is named (one line, ``ValueError``) when the view holding it enters the policy, never
when a shell builds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import is_not

from dualpath.policy.view import ClusterView, EngineState, NodeState
from dualpath.types import EngineKind


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validate_view(
    view: ClusterView,
    held_pes: Mapping[int, int],
    queued_de_groups: Mapping[int, int],
) -> None:
    """Raise ``ValueError`` naming the first inconsistency; mutate nothing.

    ``held_pes``: PE id → requests the policy holds for it (must still be a PE in the view);
    ``queued_de_groups``: DE group id → requests in its private queue (group must exist).
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
        _check_node_counts(n)
        last = n.node_id
        nodes[n.node_id] = n
    de_group_ids: set[int] = set()
    last = -1
    kinds: dict[int, EngineKind] = {}
    de = EngineKind.DE
    members: dict[int, list[EngineState]] = {}
    for e in view.engines:
        _check_engine(e, last, nodes)
        last = e.engine_id
        kind = e.kind
        kinds[last] = kind
        if kind is de:
            de_group_ids.add(e.group_id)
            members.setdefault(e.group_id, []).append(e)
    if view.generated:
        _check_generated(view.generated, [members[g] for g in sorted(members)])
    check_holds(kinds, de_group_ids, held_pes, queued_de_groups)


def _check_generated(
    generated: tuple[tuple[int, ...], ...], groups: list[list[EngineState]]
) -> None:
    if not isinstance(generated, tuple) or len(generated) != len(groups):
        n = len(generated) if isinstance(generated, tuple) else type(generated).__name__
        raise ValueError(
            f"view.generated: {n} entries for {len(groups)} DE groups: it must hold one tuple "
            "per DE group, in group id order"
        )
    for values, des in zip(generated, groups, strict=True):
        gid = des[0].group_id
        if not isinstance(values, tuple) or len(values) != len(des):
            raise ValueError(
                f"view.generated: DE group {gid} has {len(des)} members, got {values!r}"
            )
        for e, g in zip(des, values, strict=True):
            if not _is_count(g):
                raise ValueError(
                    f"engine {e.engine_id}: generated={g!r} is invalid: must be an integer >= 0"
                )
            if g and not e.seq:
                raise ValueError(f"engine {e.engine_id}: impossible state generated={g} with seq=0")


def check_holds(
    kinds: Mapping[int, EngineKind],
    de_group_ids: set[int],
    held_pes: Mapping[int, int],
    queued_de_groups: Mapping[int, int],
) -> None:
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
    if tokens and not seq:
        raise ValueError(f"engine {eid}: impossible state tokens={tokens} with seq=0")
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


def changed(new: Sequence[object], old: Sequence[object]) -> list[int]:
    """Indices where ``new`` holds another object than ``old`` (an identity scan in C)."""
    return list(compress(range(len(new)), map(is_not, new, old)))


def node_counts_ok(n: NodeState) -> bool:
    q, b = n.read_queue_tokens, n.bytes_read
    return type(q) is int and q >= 0 and type(b) in (int, float) and 0.0 <= b < float("inf")


def _check_node_counts(n: NodeState) -> None:
    if not _is_count(n.read_queue_tokens):
        raise ValueError(
            f"node {n.node_id}: read_queue_tokens={n.read_queue_tokens!r} is invalid: must be "
            "an integer >= 0"
        )
    b = n.bytes_read
    if isinstance(b, bool) or not isinstance(b, int | float) or not 0.0 <= b < float("inf"):
        raise ValueError(f"node {n.node_id}: bytes_read={b!r} is invalid: must be finite and >= 0")


def _check_counts(e: EngineState) -> None:
    for name in ("engine_id", "node_id", "group_id", "seq", "tokens", "free_hbm_tokens"):
        value = getattr(e, name)
        if not _is_count(value):
            raise ValueError(
                f"engine {e.engine_id}: {name}={value!r} is invalid: must be an integer >= 0"
            )
