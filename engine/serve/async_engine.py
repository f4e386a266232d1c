"""``LLMEngine`` behind asyncio: one background thread owns the engine and runs its steps.

Handlers never touch the engine. They post commands (add, abort) that the engine thread applies
between steps, and each request's outputs come back through an ``OutputMailbox``, fed from the
engine thread with ``call_soon_threadsafe``. An add answers through a future, so a prompt or
sampling parameter the engine rejects raises ``ValueError`` in the handler. An abort frees the
request's KV blocks before the next step runs.

Shutdown has two stages: ``drain`` refuses new requests (and makes ``alive`` false) while the
running ones go on; ``abort_all`` ends those (each gets its final output, finish reason
"abort"); ``shutdown`` then stops the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

from pagedspec.engine.core.llm_engine import LLMEngine
from pagedspec.engine.core.processor import PromptType
from pagedspec.engine.distributed.comm import WorkerError
from pagedspec.engine.outputs import EngineStats, RequestOutput
from pagedspec.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OutputMailbox:
    """Where the engine thread leaves outputs for one handler (one or more requests): only each
    request's newest unread output is kept. Outputs are cumulative, so the newest holds all an
    older unread one did; a client that reads slowly (a stalled stream) costs one output per
    request, not one per step (which, each holding every token so far, grew quadratically).
    Requests are read in the order their first unread output arrived; an error is read after
    the outputs already there. Event-loop side only."""

    _ERROR = object()  # the key an exception is kept under

    def __init__(self) -> None:
        self._unread: dict[object, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._unread)

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        key = self._ERROR if isinstance(item, BaseException) else item.request_id
        self._unread[key] = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._unread:
            self._ready.clear()
            await self._ready.wait()
        return self._unread.pop(next(iter(self._unread)))


class QueueFullError(Exception):
    """More requests are waiting than the server's bound allows."""


class EngineDeadError(Exception):
    """The engine thread has stopped: shutdown, or a tensor-parallel rank is gone."""


ABORT_ALL = object()  # the command that aborts every request, delivering its final output


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    mailbox: OutputMailbox
    done: concurrent.futures.Future
    priority: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Condition()
        self._commands: list[_Add | str | object] = []  # an add, an id to abort, ABORT_ALL
        self._mailboxes: dict[str, OutputMailbox] = {}  # engine thread only
        self._stats = engine.get_stats()  # replaced after every step, read by anyone
        self._pending_adds = 0  # posted but not applied; guarded by _wake
        self._stopping = False
        self._draining = False  # no new request is taken; the running ones go on
        self._stop_reason = "the server is shutting down"  # what refused requests are told
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- event-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not (self._stopping or self._draining)

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def num_waiting(self) -> int:
        with self._wake:
            return self._stats.num_waiting + self._pending_adds

    async def add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        mailbox: OutputMailbox,
        priority: int = 0,
    ) -> None:
        """Add a request whose outputs (or an exception) will be left in ``mailbox``. Raises
        ValueError (the engine rejected it), QueueFullError or EngineDeadError. Cancelled
        while the engine thread adds it, it is aborted right after. A constraint is compiled
        here first, in a worker thread (its errors raised here too): the engine thread then
        finds it in the cache, and the other requests keep stepping meanwhile."""
        if params.structured_outputs is not None:
            check = self.engine.processor.check_constraint
            await asyncio.to_thread(check, params.structured_outputs)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if not self.alive:
                raise EngineDeadError(self._stop_reason)
            if self._stats.num_waiting + self._pending_adds >= self.max_queue:
                raise QueueFullError(f"{self.max_queue} requests are already waiting")
            self._pending_adds += 1
            self._commands.append(_Add(request_id, prompt, params, mailbox, done, priority))
            self._wake.notify()
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._commands.append(request_id)
            self._wake.notify()

    def drain(self) -> None:
        """Take no new request (``add`` raises EngineDeadError); the running ones go on."""
        with self._wake:
            self._draining = True

    def abort_all(self) -> None:
        """Abort every request the engine holds; each handler gets its final output."""
        with self._wake:
            self._commands.append(ABORT_ALL)
            self._wake.notify()

    def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # --- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._wake.wait()
                commands, self._commands = self._commands, []
                if self._stopping:
                    self._refuse(commands)
                    break
                self._apply(commands)
                self._stats = engine.get_stats()
            try:
                outputs = engine.step()
            except WorkerError as error:  # the engine cannot step again: stop serving
                logger.exception("tensor-parallel group lost; the server stops serving")
                with self._wake:  # before failing the requests: their clients may ask /health
                    self._stopping = True
                    self._stop_reason = f"the engine has stopped: {error}"
                self._fail_all(error)
                continue
            except Exception as error:  # noqa: BLE001 - a step that failed for every request
                logger.exception("engine step failed; aborting every request")
                self._fail_all(error)
                continue
            self._stats = engine.get_stats()
            self._deliver(outputs)
        self._fail_all(EngineDeadError("the server shut down"))

    def _apply(self, commands: list[_Add | str | object]) -> None:
        """Runs under ``_wake``: adds and aborts, in the order they were posted."""
        for command in commands:
            if command is ABORT_ALL:
                for request_id in list(self.engine.requests):
                    self.engine.abort_request(request_id)
                try:
                    self._deliver(self.engine.step())  # the aborts' outputs; nothing else runs
                except Exception as error:  # noqa: BLE001 - as a failed step: fail them all
                    logger.exception("the step delivering the aborts failed")
                    self._fail_all(error)
                continue
            if isinstance(command, str):
                self.engine.abort_request(command)  # False when it already finished
                self._mailboxes.pop(command, None)
                continue
            self._pending_adds -= 1
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, command.priority
                )
            except Exception as error:  # noqa: BLE001 - handed to the request's handler
                command.done.set_exception(error)
                continue
            self._mailboxes[command.request_id] = command.mailbox
            command.done.set_result(None)

    def _refuse(self, commands: list[_Add | str | object]) -> None:
        """Runs under ``_wake`` at shutdown: adds not applied yet fail in their handlers."""
        for command in commands:
            if isinstance(command, _Add):
                self._pending_adds -= 1
                command.done.set_exception(EngineDeadError(self._stop_reason))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            mailbox = self._mailboxes.get(out.request_id)
            if mailbox is None:  # aborted by its handler: nobody listens
                continue
            if out.finished:
                del self._mailboxes[out.request_id]
            items.append((mailbox, out))
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self.engine.step()  # returns the aborts' outputs; their blocks are already free
        self._stats = self.engine.get_stats()
        items = [(mailbox, error) for mailbox in self._mailboxes.values()]
        self._mailboxes.clear()
        if items:
            self._loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[OutputMailbox, RequestOutput | BaseException]]) -> None:
    for mailbox, item in items:
        mailbox.put_nowait(item)
