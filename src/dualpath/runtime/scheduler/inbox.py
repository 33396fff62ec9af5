"""The scheduler's doors from other threads (a server's): submissions and cancels are queued
here and taken by the loop at the top of its next round, which a wake-up message starts at
once. Owns the two queues only."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from dualpath.runtime.requests import AgentState
from dualpath.runtime.sampling import SamplingParams
from dualpath.runtime.scheduler.streams import TokenCallback

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Submission:
    """A turn of ``agent`` submitted from another thread; ``future`` gets its request id or
    the ValueError of a bad request."""

    agent: AgentState
    append: tuple[int, ...]
    output_tokens: int
    on_tokens: TokenCallback | None
    future: Future[int]
    sampling: SamplingParams | None


class Inbox:
    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # makes the loop take what was queued now, not at its next round
        self._submissions: queue.SimpleQueue[Submission] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[int] = queue.SimpleQueue()

    def submit(self, item: Submission) -> None:
        self._submissions.put(item)
        self._wake()

    def cancel(self, request_id: int) -> None:
        self._cancels.put(request_id)
        self._wake()

    def cancels(self) -> Iterator[int]:
        """The request ids cancelled since the last call (the loop's thread)."""
        return _drain(self._cancels)

    def submissions(self) -> Iterator[Submission]:
        """The turns submitted since the last call, in order (the loop's thread)."""
        return _drain(self._submissions)


def _drain(q: queue.SimpleQueue[T]) -> Iterator[T]:
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
