"""Block writes handed to the storage workers and not yet acknowledged, per node, in the order
they were handed on. The slot of a write is freed on its ack, never by the worker: a worker
killed with writes taken hands them, slots intact, to its successor (a write is idempotent:
a block already stored is acknowledged as such). Owns the outstanding writes only, each with
the node whose DRAM tier keeps a copy once it is durable (``dram-tier``; -1: none)."""

from __future__ import annotations

from dualpath.runtime.messages import PersistMsg


class Writes:
    def __init__(self) -> None:
        # node → slot → (the write, its tier node): a slot holds one block until its ack
        self._out: dict[int, dict[int, tuple[PersistMsg, int]]] = {}

    def sent(self, msg: PersistMsg, tier_node: int = -1) -> None:
        """``msg`` was handed to node ``msg.node``'s storage worker."""
        self._out.setdefault(msg.node, {})[msg.slot] = (msg, tier_node)

    def acked(self, node: int, slot: int) -> tuple[PersistMsg, int] | None:
        """The write in ``slot`` of ``node`` was acknowledged (written or dropped): the write
        and its tier node when it was outstanding (its slot is then the caller's to free);
        None: a duplicate ack, of a write handed on twice."""
        return self._out.get(node, {}).pop(slot, None)

    def outstanding(self, node: int) -> list[PersistMsg]:
        """Node ``node``'s unacknowledged writes, oldest first (dicts keep insertion order)."""
        return [msg for msg, _ in self._out.get(node, {}).values()]

    def __len__(self) -> int:
        return sum(len(w) for w in self._out.values())
