"""Durability: which persisted blocks the storage workers acknowledged, which a finished turn
handed them that are not yet acknowledged (in flight), and the server submissions that wait
for those. A turn's answer never waits for its blocks (its client gets the last token when
the DE produces it); a resend of the conversation that would hit a block still in flight
waits for that block's ack before its hits are looked up, so it hits what the turn persisted
and the store only ever advertises durable blocks. A turn that was live when a storage worker
died may have had writes taken by it, which will never be acknowledged: its blocks are never
waited for (a resend goes at once and recomputes what is missing; the tokens are the same).
Owns the acks, the in-flight keys and the waiting submissions; submitting them is the
caller's (it gets them back)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class Durability:
    def __init__(self) -> None:
        # block keys whose write the storage workers acknowledged, written or dropped (a
        # failed write's ack may arrive before the DE's DecodeDoneMsg: it must still count)
        self.acked: set[str] = set()
        self.in_flight: set[str] = set()  # handed to storage by finished turns, not acked
        # submissions (opaque to this class) waiting for in-flight keys, in arrival order
        self.waiting: list[tuple[frozenset[str], Any]] = []
        # turns live when a storage worker died: their writes may be lost, never wait on them
        self.suspect: set[int] = set()

    def pending(self, keys: Iterable[str]) -> set[str]:
        """The keys of ``keys`` not acknowledged yet."""
        return {k for k in keys if k not in self.acked}

    def handed(self, request_id: int, keys: Iterable[str]) -> set[str]:
        """Turn ``request_id`` finished, its blocks ``keys`` handed to storage: in flight
        until acknowledged. Returns those to wait for (none for a turn live across a storage
        worker's death: ``lost``)."""
        if request_id in self.suspect:
            self.suspect.discard(request_id)
            return set()
        pending = self.pending(keys)
        self.in_flight.update(pending)
        return pending

    def hold(self, keys: Iterable[str], submission: Any) -> bool:
        """Hold ``submission`` (whose prompt's blocks are ``keys``) while one of them is in
        flight; False: it can go now (never behind another's wait)."""
        waits = frozenset(k for k in keys if k in self.in_flight)
        if not waits:
            return False
        self.waiting.append((waits, submission))
        return True

    def acked_key(self, key: str) -> list[Any]:
        """A write of ``key`` was acknowledged (written or dropped): the submissions that can
        go now, in the order they came."""
        self.acked.add(key)
        self.in_flight.discard(key)
        return self._release()

    def lost(self, live: Iterable[int]) -> list[Any]:
        """Writes were lost (a storage worker died): they will never be acknowledged, so
        every held submission goes now (it recomputes what is missing), and the turns
        ``live`` now (request ids) are never waited for when they finish."""
        self.in_flight.clear()
        self.suspect.update(live)
        return self._release()

    def forget(self, request_id: int) -> None:
        """Turn ``request_id`` ended without finishing (aborted)."""
        self.suspect.discard(request_id)

    def _release(self) -> list[Any]:
        out = [sub for waits, sub in self.waiting if not waits & self.in_flight]
        if out:
            self.waiting = [(w, sub) for w, sub in self.waiting if w & self.in_flight]
        return out

    @property
    def busy(self) -> bool:
        """A submission waits for blocks in flight."""
        return bool(self.waiting)
