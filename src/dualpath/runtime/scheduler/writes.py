"""Block writes handed to the storage workers and not yet acknowledged, per node, in the order
they were handed on. The slot of a write is freed on its ack, never by the worker: a worker
killed with writes taken hands them, slots intact, to its successor (a write is idempotent:
a block already stored is acknowledged as such). Owns the outstanding writes only."""

from __future__ import annotations

from dualpath.runtime.messages import PersistMsg


class Writes:
    def __init__(self) -> None:
        # node → slot → the write (a slot holds one block until its ack: the key is unique)
        self._out: dict[int, dict[int, PersistMsg]] = {}

    def sent(self, msg: PersistMsg) -> None:
        """``msg`` was handed to node ``msg.node``'s storage worker."""
        self._out.setdefault(msg.node, {})[msg.slot] = msg

    def acked(self, node: int, slot: int) -> bool:
        """The write in ``slot`` of ``node`` was acknowledged (written or dropped): True when it
        was outstanding (its slot is then the caller's to free; False: a duplicate ack, of a
        write handed on twice)."""
        return self._out.get(node, {}).pop(slot, None) is not None

    def outstanding(self, node: int) -> list[PersistMsg]:
        """Node ``node``'s unacknowledged writes, oldest first (dicts keep insertion order)."""
        return list(self._out.get(node, {}).values())

    def __len__(self) -> int:
        return sum(len(w) for w in self._out.values())
