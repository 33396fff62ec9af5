"""Token streams: the callbacks of turns whose client wants their tokens as they come (a
server's), and the one place they are called. Owns the callbacks only."""

from __future__ import annotations

from collections.abc import Callable

from dualpath.runtime.requests import Req

# on_tokens(request_id, tokens so far, done): the first token when prefill ends, then each
# decode step's with ``RuntimeOptions.stream_tokens``, then all (done)
TokenCallback = Callable[[int, tuple[int, ...], bool], None]


class Streams:
    def __init__(self) -> None:
        self.callbacks: dict[int, TokenCallback] = {}

    def watch(self, request_id: int, callback: TokenCallback) -> None:
        self.callbacks[request_id] = callback

    def watches(self, request_id: int) -> bool:
        return request_id in self.callbacks

    def drop(self, request_id: int) -> TokenCallback | None:
        """Stop streaming ``request_id`` (its client is gone, or it is resubmitted)."""
        return self.callbacks.pop(request_id, None)

    def emit(self, req: Req, tokens: tuple[int, ...], done: bool) -> None:
        """``req``'s output so far (all of it when ``done``: its stream ends)."""
        cb = self.callbacks.get(req.request_id)
        if cb is not None:
            cb(req.request_id, tokens, done)
            if done:
                del self.callbacks[req.request_id]
