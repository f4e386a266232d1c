"""Responses that notice a client going away.

Starlette's ``StreamingResponse`` only notices a disconnect when a write fails (ASGI 2.4+),
which for a stream waiting on the engine is one token late, and a non-streaming handler never
notices. Here both race their work against the ASGI ``http.disconnect`` message (as vLLM does)
and cancel the loser, so the engine requests are aborted as soon as the client has gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, cancelled if the client disconnects first (ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the stream ends (done, error,
    disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(receive, self.stream_response(send))
        except (ClientDisconnected, OSError):
            pass
        finally:
            self.on_close()
            await self.body_iterator.aclose()
