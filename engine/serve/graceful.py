"""Uvicorn's server with a shutdown that ends every request properly.

Uvicorn's own, on SIGTERM, closes the listening socket at once and, once its timeout is up,
cancels the handlers still running: their streams stop mid-response (no final chunk, no
``[DONE]``), a waiting non-streaming client gets a plain-text 500, and the log shows the
``CancelledError`` tracebacks. Here the first SIGTERM or SIGINT drains instead:

1. the engine takes no new request (503), ``/health`` answers 503, and the running requests
   go on, for up to ``drain_timeout`` seconds;
2. then the engine aborts what is left: each stream ends with a chunk whose finish reason is
   ``"abort"`` and ``[DONE]``, each waiting non-streaming client gets a 503 error body;
3. once no response is being written, uvicorn's shutdown runs and finds nothing to cancel.

A second signal during the drain is uvicorn's as usual: its own graceful shutdown starts (a
further Ctrl-C forces the exit).
"""

from __future__ import annotations

import asyncio
import time
from types import FrameType

import uvicorn

from pagedspec.engine.serve.async_engine import AsyncEngine

POLL_S = 0.05
FINISH_S = 5.0  # how long the handlers may take to write their last bytes after the aborts


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future | None = None

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised once served: the process exits by it
        self._drain = asyncio.run_coroutine_threadsafe(self._drain_then_exit(), self._loop)

    async def _drain_then_exit(self) -> None:
        try:
            self.engine.drain()
            if not await self._handlers_done(self.drain_timeout):
                self.engine.abort_all()
                await self._handlers_done(FINISH_S)
        finally:  # whatever happened, the server stops
            self.should_exit = True

    async def _handlers_done(self, timeout: float) -> bool:
        """Whether every request handler has finished within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.server_state.tasks:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True
