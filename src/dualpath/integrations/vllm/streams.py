"""The router's streamed answers: an SSE relay whose request is closed however the response
ends (``Relay``), and a batched prompt's streams joined into one (``joined``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dualpath.integrations.vllm.fanout import StreamJoin


class Relay(StreamingResponse):
    """A stream whose request is closed however the response ends, started or not (a client
    gone before the first byte never runs the body's ``finally``)."""

    def __init__(
        self, body: AsyncIterator[bytes], on_close: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.events = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()

    async def discard(self) -> None:
        """Never sent: its request closed (what it holds given back)."""
        with contextlib.suppress(Exception):
            await self.events.aclose()  # type: ignore[attr-defined]
        await self._on_close()


async def nothing() -> None:
    return None


async def joined(streams: list[Relay], join: StreamJoin) -> AsyncIterator[bytes]:
    """The streams of a batch's prompts, interleaved as their events come, as one stream
    (``fanout.StreamJoin``); every stream's request closed however it ends."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: Relay) -> None:
        tail = b""
        try:
            async for chunk in stream.events:
                tail += chunk
                *events, tail = tail.split(b"\n\n")
                for e in events:
                    await queue.put((i, e))
            if tail:
                await queue.put((i, tail))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, event = await queue.get()
            if event is None:
                left -= 1
            elif out := join.event(i, event):
                yield out
        yield join.close()
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.discard()
