"""The embedded engine loop: ``add_request`` / ``step``.

A step: ``Scheduler.schedule`` picks sequences and reserves their KV slots (``spec.lookahead``
draft slots each) → ``spec.prepare`` lays out the spans → ``ModelRunner.forward`` runs them in
one packed batch → ``spec.verify`` samples (and verifies drafts) → per sample, the
``OutputProcessor`` keeps tokens up to a stop, ``spec.commit`` records the round and
``Scheduler.update`` commits them and rolls the block table back past rejected drafts.
Everything about a sequence rides on its one record (``seq.owner``, a ``SampleState``).

Nothing moves before the commit: if the forward or sampling raises, the engine finds the
request(s) that fail on their own and aborts them (their outputs carry the error); the others
run next step as if nothing happened.
"""

from __future__ import annotations

import itertools
import weakref

from engine.async_steps import AsyncSteps
from engine.build import EngineParts, build_engine_parts
from engine.config import EngineConfig
from engine.distributed.group import WorkerError
from engine.gc_pause import collection_deferred
from engine.outputs import EngineStats, RequestOutput
from engine.processor import PromptType
from engine.request import Request, SampleState
from engine.sample_jobs import SampleResult
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.spec_decode.round import Round
from scheduler import ScheduledSequence, SchedulerOutput, Sequence, SequenceStatus

FINISHED = SequenceStatus.FINISHED
CUMULATIVE = RequestOutputKind.CUMULATIVE
NO_RESULT = SampleResult([], None)  # a prompt chunk that does not reach the end samples nothing


class LLMEngine:
    def __init__(self, config: EngineConfig):
        parts: EngineParts = build_engine_parts(config)
        self.config, self.tokenizer = config, parts.tokenizer
        self.processor, self.block_manager = parts.processor, parts.block_manager
        self.vocab_size = parts.processor.vocab_size
        self.max_model_len = parts.processor.max_model_len
        self.scheduler, self.runner, self.spec = parts.scheduler, parts.runner, parts.spec
        self.step_sampler, self.outputs = parts.step_sampler, parts.output_processor
        self.requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count(1)
        self._closed = False
        step = AsyncSteps(self).step if config.async_scheduling else self._step
        self._next_step = collection_deferred(step)  # (it runs when the step returns)
        self._tp = parts.tp  # its workers stop when the engine is collected, shut down, or at exit
        if self._tp is not None:
            weakref.finalize(self, self._tp.shutdown)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0) -> None:  # fmt: skip
        """``priority`` orders requests under ``scheduling_policy="priority"`` (lower first)."""
        self._check_open()
        p = self.processor.process(prompt, params, request_id, self.requests, priority)
        request = Request(request_id, p.prompt, p.prompt_token_ids, p.params)
        seq = Sequence(next(self._seq_ids), p.prompt_token_ids)
        seq.seats, seq.priority = p.params.n, priority  # forks take the seats after the prompt
        seq.reuses_cache = p.params.prompt_logprobs is None  # else every prompt row is needed
        self.outputs.new_sample(request, seq, 0)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Finish it with "abort" now (blocks free at once); its output comes next step."""
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is not None:
            self._aborted.append(self._abort(request))
        return request is not None

    def shutdown(self) -> None:
        """Abort every request, stop the tensor-parallel workers (as when it is collected); the
        engine takes no request or step after this."""
        for request in list(self.requests.values()):
            self._abort(request)
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

    def _step(self) -> list[RequestOutput]:
        scheduler = self.scheduler
        busy = len(scheduler.running) + len(scheduler.waiting)
        sched = scheduler.schedule(self.spec.lookahead(busy))
        for seq in sched.preempted:
            self.spec.reset(seq.owner)
        if sched.is_empty:
            return []
        try:
            round, results = self._execute(sched)
        except WorkerError:  # no request is at fault: the engine itself is gone
            raise
        except Exception as error:  # noqa: BLE001 - isolated below, or re-raised
            return self._isolate_failure(sched, error)
        return self._commit(round, results)

    def _execute(self, sched: SchedulerOutput) -> tuple[Round, list[list[SampleResult]]]:
        """Draft, forward, sample and verify; changes no sequence, request or drafter state."""
        self.runner.copy_blocks(sched.blocks_to_copy)
        round = self.spec.prepare(sched)
        output = self.runner.forward(round.spans, **round.forward_options)
        return round, self.spec.verify(round, output)

    def _commit(self, round: Round, results: list[list[SampleResult]]) -> list[RequestOutput]:
        """Per sample (a finished prompt of n samples forks first): keep its tokens up to a
        stop, record the round, move the sequence; then the outputs of the requests that
        progressed (a finished one has left ``self.requests``)."""
        progressed: dict[str, Request] = {}
        append, spec_commit, requests = self.outputs.append, self.spec.commit, self.requests
        update, finish = self.scheduler.update, self.scheduler.finish
        for i, (s, samples) in enumerate(zip(round.scheduled, results, strict=True)):
            if s.seq.status is FINISHED:  # its request was aborted earlier in this loop
                continue
            record: SampleState = s.seq.owner
            request = record.request
            try:  # a prompt chunk has no result; a finished prompt of n samples has n
                if (entries := round.prompt_logprobs.get(i)) is not None:  # (s.start + 1 on)
                    self.outputs.add_prompt_logprobs(request, s.start + 1, entries)
                one = len(samples) < 2  # (then no zip: it costs a tenth of this loop's body)
                pairs = ((record, samples[0] if samples else NO_RESULT),) if one else zip(
                    self._fork(record, len(samples)), samples, strict=True)  # fmt: skip
                for sample, result in pairs:
                    kept = append(sample, result.token_ids, result.logprobs)
                    num_computed = s.end + len(kept) - 1 if kept else s.end  # accepted drafts'
                    covered = spec_commit(round, i, sample, len(result.token_ids), kept)
                    cacheable = num_computed if covered is None else min(num_computed, covered)
                    update(sample.seq, num_computed, kept, cacheable)
                    if sample.finish_reason is not None:
                        finish(sample.seq)
                if done := record.finish_reason is not None and request.finished:
                    del requests[request.request_id]
            except Exception as error:  # noqa: BLE001 - this request alone is aborted
                self._abort(request, error)
                progressed[request.request_id] = request
                continue
            if s.samples and (done or request.params.output_kind is CUMULATIVE):
                progressed[request.request_id] = request
        return [self.outputs.output(r, r.request_id not in requests) for r in progressed.values()]

    def _fork(self, parent: SampleState, n: int) -> list[SampleState]:
        """A finished prompt and n - 1 forks of it sharing its blocks: its n samples."""
        forks = [self.scheduler.fork(parent.seq, next(self._seq_ids)) for _ in range(1, n)]
        new = self.outputs.new_sample
        return [parent] + [new(parent.request, seq, i, parent) for i, seq in enumerate(forks, 1)]

    def _isolate_failure(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Re-run each request's part of the failed step on its own (committing nothing) and
        abort those that fail alone; if none does, re-raise: every request is as it was."""
        by_request: dict[str, list[ScheduledSequence]] = {}
        for s in sched.scheduled:
            by_request.setdefault(s.seq.owner.request.request_id, []).append(s)
        outputs = []
        for request_id, scheduled in by_request.items():
            try:
                self._execute(SchedulerOutput(scheduled))
            except WorkerError:
                raise
            except Exception as own_error:  # noqa: BLE001 - this request is the culprit
                outputs.append(self._abort(self.requests[request_id], own_error))
        if not outputs:
            raise error
        return outputs

    def _abort(self, request: Request, error: Exception | None = None) -> RequestOutput:
        """Finish every sample not yet retired with "abort" and free its blocks (even one a
        failed commit had just finished: it would hold its blocks forever)."""
        if error is not None:
            request.error = f"{type(error).__name__}: {error}"
        for sample in request.samples:
            if sample.seq.status is not FINISHED:
                sample.finish_reason = "abort"
                self.scheduler.finish(sample.seq)
        self.requests.pop(request.request_id, None)
        return self.outputs.aborted(request)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down: make a new LLMEngine")
