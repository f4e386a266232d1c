"""The engine requests behind one HTTP request (one per prompt), read as one stream.

They share one mailbox (``OutputMailbox``: the newest unread output of each), so their outputs
arrive interleaved in engine order. Whatever
ends the HTTP request (done, error, disconnect, cancellation) calls ``close``, which aborts the
ones still running: their KV blocks are freed before the engine's next step. Latency and token
metrics are recorded here, where every output passes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from pagedspec.engine.core.processor import PromptType
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.serve.async_engine import AsyncEngine, OutputMailbox
from pagedspec.engine.serve.metrics import ServerMetrics


@dataclass
class _Timing:
    start: float
    last: float | None = None  # when its last new token arrived
    num_tokens: int = 0


@dataclass
class RequestGroup:
    engine: AsyncEngine
    metrics: ServerMetrics
    request_ids: list[str]
    n: int  # choices per request
    mailbox: OutputMailbox = field(default_factory=OutputMailbox)
    unfinished: set[str] = field(default_factory=set)
    timings: dict[str, _Timing] = field(default_factory=dict)

    @classmethod
    async def start(
        cls,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        priority: int = 0,
    ) -> RequestGroup:
        """Add one engine request per prompt; if any is rejected, abort the others and raise
        the first rejection (ValueError, QueueFullError, EngineDeadError)."""
        base = uuid.uuid4().hex
        group = cls(engine, metrics, [f"{base}-{i}" for i in range(len(prompts))], params.n)
        now = time.perf_counter()
        adds = [
            engine.add(rid, prompt, params, group.mailbox, priority)
            for rid, prompt in zip(group.request_ids, prompts, strict=True)
        ]
        added = await asyncio.gather(*adds, return_exceptions=True)
        group.unfinished = {
            rid for rid, e in zip(group.request_ids, added, strict=True) if e is None
        }
        group.timings = {rid: _Timing(now) for rid in group.request_ids}
        errors = [e for e in added if isinstance(e, BaseException)]
        if errors:
            group.close()
            raise errors[0]
        return group

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output of every request until all have finished."""
        while self.unfinished:
            item = await self.mailbox.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            self._record(item)
            yield item

    async def final_outputs(self) -> list[RequestOutput]:
        """The finished output of each request, in prompt order."""
        final = {}
        async for out in self.outputs():
            if out.finished:
                final[out.request_id] = out
        return [final[rid] for rid in self.request_ids]

    def close(self) -> None:
        """Abort the requests still running (their choices count as finished by "abort")."""
        for request_id in self.unfinished:
            self.engine.abort(request_id)
            self.metrics.requests.labels(finished_reason="abort").inc(self.n)
        self.unfinished.clear()

    def _record(self, out: RequestOutput) -> None:
        timing, now, m = self.timings[out.request_id], time.perf_counter(), self.metrics
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > timing.num_tokens:
            if timing.last is None:
                m.ttft.observe(now - timing.start)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                m.itl.observe(now - timing.last)
            m.generation_tokens.inc(num_tokens - timing.num_tokens)
            timing.last, timing.num_tokens = now, num_tokens
        if out.finished:
            m.e2e.observe(now - timing.start)
            for c in out.outputs:
                m.requests.labels(finished_reason=c.finish_reason or "abort").inc()
