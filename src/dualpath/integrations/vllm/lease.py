"""The slots one request of the DualPath router holds in the node buffers (``Lease``).

Its owner tag is what every buffer records for those slots; the decode instance claims them
from it, a prefill instance pins them, a side-car adopts them to persist. The lease is the one
place on the router's side that gives slots back: every grant is recorded on it as it lands,
and its request's one exit (``request.Request.close``) closes it.
"""

from __future__ import annotations

from collections.abc import Callable


class Lease:
    """The slots one request holds in the node buffers under its owner tag (> 0: instances'
    tags are < 0, anonymous slots 0). Every grant is recorded here the moment it lands, even
    one that lands after its asker left (a deadline, the client gone); ``give_back`` is the
    only way the router's side returns slots, and once the lease is ``closed`` a late grant
    goes straight back."""

    def __init__(self, tag: int, release: Callable[[int, list[int], int], None]) -> None:
        self.tag = tag
        self.held: dict[int, list[int]] = {}  # node → slots, in the order they were granted
        self.closed = False
        self._release = release

    def took(self, node: int, slots: list[int]) -> None:
        """``slots`` of ``node`` were granted under this lease."""
        if not slots:
            return
        self.held.setdefault(node, []).extend(slots)
        if self.closed:
            self.give_back(node)

    def give_back(self, node: int | None = None) -> None:
        """What the lease still holds on ``node`` (None: on every node) back to its buffer.
        Slots handed on meanwhile (the decode claimed them, a side-car adopted them to
        persist) stay with their new holder: a buffer frees only what is still the lease's."""
        for n in list(self.held) if node is None else [node]:
            slots = self.held.pop(n, [])
            if slots:
                self._release(n, slots, self.tag)

    def close(self) -> None:
        self.closed = True
        self.give_back()
