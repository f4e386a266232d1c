"""The embedded engine loop: ``add_request`` / ``step`` / ``abort_request``.

``LLMEngine`` owns the request table (``requests``: the running requests by id) and picks the
step: ``Step`` (synchronous, ``pagedspec.engine.core.step``) or, with ``async_scheduling``,
``AsyncStep`` on the same parts. Both commit through one ``StepCommit``. Everything about a
sequence rides on its one record (``seq.owner``, a ``SampleState``).
"""

from __future__ import annotations

import itertools
import weakref

from pagedspec.engine.config import EngineConfig
from pagedspec.engine.core.async_step import AsyncStep
from pagedspec.engine.core.build import EngineParts, build_engine_parts
from pagedspec.engine.core.commit import StepCommit
from pagedspec.engine.core.gc_pause import collection_deferred
from pagedspec.engine.core.processor import PromptType
from pagedspec.engine.core.step import Step
from pagedspec.engine.outputs import EngineStats, RequestOutput
from pagedspec.engine.request import Request
from pagedspec.engine.sample.round import NoSpeculation
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.scheduler import Sequence


class LLMEngine:
    def __init__(self, config: EngineConfig):
        parts: EngineParts = build_engine_parts(config)
        self.config, self.tokenizer = config, parts.tokenizer
        self.processor, self.block_manager = parts.processor, parts.block_manager
        self.vocab_size = parts.processor.vocab_size
        self.max_model_len = parts.processor.max_model_len
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.step_sampler, self.outputs = parts.step_sampler, parts.output_processor
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count(1)
        self._closed = False
        self.commit = StepCommit(self.scheduler, self.outputs, self.requests, self._seq_ids)
        self._sync = step = Step(self.scheduler, self.runner, parts.spec, self.commit)
        if config.async_scheduling:
            step = AsyncStep(step, self.step_sampler, self.max_model_len)
        self._next_step = collection_deferred(step)  # (it runs when the step returns)
        self._tp = parts.tp  # its workers stop when the engine is collected, shut down, or at exit
        if self._tp is not None:
            weakref.finalize(self, self._tp.shutdown)

    @property
    def spec(self) -> NoSpeculation:
        """The round every step runs: ``Speculation``, or ``NoSpeculation`` (speculation off)."""
        return self._sync.spec

    @spec.setter
    def spec(self, spec: NoSpeculation) -> None:
        """Later steps run ``spec`` (the EAGLE trainer's feature capture swaps it in)."""
        self._sync.spec = spec

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0) -> None:  # fmt: skip
        """``priority`` orders requests under ``scheduling_policy="priority"`` (lower first)."""
        self._check_open()
        p = self.processor.process(prompt, params, request_id, self.requests, priority)
        request = Request(request_id, p.prompt, p.prompt_token_ids, p.params)
        seq = Sequence(next(self._seq_ids), p.prompt_token_ids)
        seq.seats, seq.priority = p.params.n, priority  # forks take the seats after the prompt
        seq.reuses_cache = p.params.prompt_logprobs is None  # else every prompt row is needed
        self.outputs.new_sample(request, seq, 0, draft=self.spec.new_draft())
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Finish it with "abort" now (blocks free at once); its output comes next step."""
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is not None:
            self._aborted.append(self.commit.abort(request))
        return request is not None

    def shutdown(self) -> None:
        """Abort every request, stop the tensor-parallel workers (as when it is collected); the
        engine takes no request or step after this."""
        for request in list(self.requests.values()):
            self.commit.abort(request)
        self._closed = True
        if self._tp is not None:
            self._tp.shutdown()

    def has_unfinished_requests(self) -> bool:
        """True while a request runs (an aborted one is finished at once)."""
        return bool(self.requests)

    def get_stats(self) -> EngineStats:
        return EngineStats.of(self.block_manager, self.scheduler, self.spec.stats())

    def step(self) -> list[RequestOutput]:
        """One step: the requests that progressed, the aborts since the last (kept if it raises)."""
        self._check_open()
        outputs, self._aborted = self._aborted, []
        try:
            return outputs + self._next_step()
        except BaseException:
            self._aborted = outputs + self._aborted
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down: make a new LLMEngine")
