"""Durability: which persisted blocks the storage workers acknowledged, and the finished turns
whose "done" is reported only once their blocks are durable (a server's client may resend
the conversation as soon as it has the answer: that resend must hit them). Owns the acks and
the held reports; releasing them is the caller's (it returns them)."""

from __future__ import annotations

from collections.abc import Iterable

from dualpath.runtime.requests import Req

Report = tuple[Req, tuple[int, ...]]  # a turn and its whole output, as its client sees it


class Durability:
    def __init__(self) -> None:
        # block keys whose write the storage workers acknowledged, written or dropped (a
        # failed write's ack may arrive before the DE's DecodeDoneMsg: it must still count)
        self.acked: set[str] = set()
        # rid → (keys not yet durable, request, output): done reported once they are
        self.done_after_persist: dict[int, tuple[set[str], Req, tuple[int, ...]]] = {}

    def pending(self, keys: Iterable[str]) -> set[str]:
        """The keys of ``keys`` not acknowledged yet."""
        return {k for k in keys if k not in self.acked}

    def hold_done(self, req: Req, pending: set[str], output: tuple[int, ...]) -> None:
        self.done_after_persist[req.request_id] = (pending, req, output)

    def acked_key(self, key: str) -> list[Report]:
        """A write of ``key`` was acknowledged (written or dropped): the turns now durable."""
        self.acked.add(key)
        return self._release(key)

    def lost(self) -> list[Report]:
        """Writes were lost (a storage worker died): they will never be acknowledged, so
        every held turn is released."""
        return self._release(None)

    def _release(self, key: str | None) -> list[Report]:
        out: list[Report] = []
        for rid in sorted(self.done_after_persist):
            pending, req, output = self.done_after_persist[rid]
            pending.discard(key)
            if not pending or key is None:
                del self.done_after_persist[rid]
                out.append((req, output))
        return out

    @property
    def busy(self) -> bool:
        """Some finished turn still waits to be reported done."""
        return bool(self.done_after_persist)
