"""The commit of a step: the one place a step's tokens change requests, sequences and drafters.

Per sample (a finished prompt of n samples forks first): the ``OutputProcessor`` keeps its
tokens up to a stop, the round records them (``spec.commit``: backoff, drafter state), and
``Scheduler.update`` moves the sequence and rolls its block table back past rejected drafts.
The plain, speculative and async steps all commit here; so do aborts, which finish a request's
samples and free their blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedspec.engine.core.output_processor import OutputProcessor
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.request import Request, SampleState
from pagedspec.engine.sample.round import NoSpeculation, Round, Verified
from pagedspec.engine.sample.sample_jobs import SampleResult
from pagedspec.engine.sampling_params import RequestOutputKind
from pagedspec.scheduler import Scheduler, SequenceStatus

FINISHED = SequenceStatus.FINISHED
CUMULATIVE = RequestOutputKind.CUMULATIVE
NO_RESULT = SampleResult([], None)  # a prompt chunk that does not reach the end samples nothing


class StepCommit:
    """Commits steps into the engine's request table (``requests``: the running requests by
    id, owned by ``LLMEngine``; a finished or aborted request leaves it here)."""

    def __init__(
        self,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        requests: dict[str, Request],
        seq_ids: Iterator[int],
    ) -> None:
        self.scheduler, self.outputs = scheduler, outputs
        self.requests = requests
        self.seq_ids = seq_ids  # the engine's: forks take the next ids

    def __call__(
        self, spec: NoSpeculation, round: Round, verified: Verified
    ) -> list[RequestOutput]:
        """Per sample: keep its tokens up to a stop, record the round (``spec.commit``), move
        the sequence; then the outputs of the requests that progressed (a finished one has left
        ``requests``)."""
        progressed: dict[str, Request] = {}
        append, spec_commit, requests = self.outputs.append, spec.commit, self.requests
        update, finish = self.scheduler.update, self.scheduler.finish
        prompt_logprobs = verified.prompt_logprobs
        for i, (s, samples) in enumerate(zip(round.scheduled, verified.results, strict=True)):
            if s.seq.status is FINISHED:  # its request was aborted earlier in this loop
                continue
            record: SampleState = s.seq.owner
            request = record.request
            try:  # a prompt chunk has no result; a finished prompt of n samples has n
                if (entries := prompt_logprobs.get(i)) is not None:  # (s.start + 1 on)
                    self.outputs.add_prompt_logprobs(request, s.start + 1, entries)
                one = len(samples) < 2  # (then no zip: it costs a tenth of this loop's body)
                pairs = ((record, samples[0] if samples else NO_RESULT),) if one else zip(
                    self._fork(record, len(samples)), samples, strict=True)  # fmt: skip
                for sample, result in pairs:
                    kept = append(sample, result.token_ids, result.logprobs)
                    num_computed = s.end + len(kept) - 1 if kept else s.end  # accepted drafts'
                    covered = spec_commit(round, verified, i, sample, len(result.token_ids),
                                          kept)  # fmt: skip
                    cacheable = num_computed if covered is None else min(num_computed, covered)
                    update(sample.seq, num_computed, kept, cacheable)
                    if sample.finish_reason is not None:
                        finish(sample.seq)
                if done := record.finish_reason is not None and request.finished:
                    del requests[request.request_id]
            except Exception as error:  # noqa: BLE001 - this request alone is aborted
                self.abort(request, error)
                progressed[request.request_id] = request
                continue
            if s.samples and (done or request.params.output_kind is CUMULATIVE):
                progressed[request.request_id] = request
        return [self.outputs.output(r, r.request_id not in requests) for r in progressed.values()]

    def abort(self, request: Request, error: Exception | None = None) -> RequestOutput:
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

    def _fork(self, parent: SampleState, n: int) -> list[SampleState]:
        """A finished prompt and n - 1 forks of it sharing its blocks: its n samples."""
        forks = [self.scheduler.fork(parent.seq, next(self.seq_ids)) for _ in range(1, n)]
        new = self.outputs.new_sample
        return [parent] + [new(parent.request, seq, i, parent) for i, seq in enumerate(forks, 1)]
