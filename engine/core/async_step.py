"""Async scheduling: the host schedules and launches step N + 1 before it reads step N's tokens.

A step samples on the device and leaves its tokens there; the next step is scheduled with each
of them pending (``Sequence.num_pending``), its spans name them by placeholder (``-1 - i``: the
previous step's i-th token, resolved on the device by ``ModelRunner.forward``), and only once it
is launched does the host read the previous step's tokens (and logprobs) and commit them (text,
stops, outputs, the block table). On CUDA the device runs step N + 1 meanwhile; on the CPU each
forward finishes before it returns, so the steps interleave the same way without overlapping,
which is what the CPU tests check: the outputs of synchronous steps.

A step runs this way (decodes, prefill chunks and admissions alike) when every request reads
nothing back but its tokens and logprobs (``Request.device_sampled``: greedy or sampled, seeded
or not, min_tokens, penalties (they count a pending token by its placeholder), logprobs; no
prompt logprobs or constraint), forks no samples at its prompt's end (n > 1) and has a pending
token that is not its last, and the scheduler runs every decode without preempting
(``Scheduler.runs_every_decode``); else the launched step is committed and the step runs
synchronously. It builds its spans and jobs as the synchronous step does (``plain_spans``,
``sample_jobs``) and commits through the same ``StepCommit``.

On CUDA the tokens (and logprob figures) are copied to pinned memory behind an event as the
step is launched, so reading them waits for that step only. Rows that sample (temperature, top-k
or -p), mask min_tokens or carry penalties still build small tensors from host lists after the
forward is queued, which waits for it: those steps overlap the commit only partly (not measured;
greedy rows build nothing).

A sequence that stopped at step N was launched in N + 1 too: that result is dropped (its record
is finished), and its blocks were freed at N's commit, which is safe as the device runs steps in
launch order and a freed block is handed out only by a later step. A seeded row draws what it
draws synchronously (its generator is its position's); unseeded rows share the sampler's
generator, which a dropped row also draws from: the same law, other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedspec.engine.core.step import Step
from pagedspec.engine.outputs import RequestOutput
from pagedspec.engine.sample.raw_logprobs import LogprobTensors, logprob_entries, logprob_tensors
from pagedspec.engine.sample.round import Round, Verified, plain_spans, sample_jobs
from pagedspec.engine.sample.sample_jobs import SampleResult
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.scheduler import SchedulerOutput, Sequence


@dataclass
class Launched:
    """A step launched and not read: its round, and the token of each span that samples (in
    the order of ``samplers``, indices into the round)."""

    round: Round
    samplers: list[int]
    tokens: torch.Tensor  # (the next step's placeholders name them)
    # the tokens, and per sampler j with logprobs its row's logprob figures, on the host as they
    # are done (on CUDA copied into pinned memory behind an event: the read waits for this step
    # only, not for the one launched after it)
    on_host: tuple[torch.Tensor, dict[int, LogprobTensors], torch.cuda.Event | None]


class AsyncStep:
    """The engine's steps under async scheduling, on the synchronous step's parts (``sync``:
    its scheduler, runner and round, and its commit); owns the launched step."""

    def __init__(self, sync: Step, step_sampler: StepSampler, max_model_len: int) -> None:
        self.sync = sync
        self.scheduler, self.runner, self.commit = sync.scheduler, sync.runner, sync.commit
        self.step_sampler = step_sampler
        self.max_model_len = max_model_len
        self.launched: Launched | None = None
        self.ready: list[RequestOutput] = []  # committed, not returned yet
        self.launches = 0  # steps launched async so far
        self.failed = 0  # launches that raised (their steps then ran synchronously)

    def __call__(self) -> list[RequestOutput]:
        """Launch the next step where it can run async, then commit the one launched before;
        else commit that one and run a synchronous step (which also isolates a failed launch).
        Until the launch is done, the step launched before stays ``self.launched`` (an
        interrupt there leaves it for the next step to read); outputs committed here are kept
        for the next step if the synchronous one raises."""
        previous, launched = self.launched, None
        if self._can_launch():
            sched = self.scheduler.schedule(0)
            if not sched.is_empty:  # (empty: the waiting do not fit; nothing runs)
                try:
                    launched = self._launch(sched, previous)
                except Exception:  # noqa: BLE001 - the synchronous step below meets it again
                    self.failed += 1
        self.launched = launched
        if previous is not None:
            self.ready += self._read(previous)
        if launched is None:
            self.ready += self.sync()
        ready, self.ready = self.ready, []
        return ready

    def _can_launch(self) -> bool:
        """Every request (running, or admissible this step) reads nothing but its tokens and
        forks no samples at its prompt's end, no pending token is its sequence's last, and the
        scheduler gives every running sequence its token without preempting."""
        scheduler = self.scheduler
        if not scheduler.has_unfinished() or not scheduler.runs_every_decode():
            return False
        limit = self.max_model_len
        for seq in scheduler.running:
            request = seq.owner.request
            length = len(seq.token_ids) + seq.num_pending
            outputs = length - seq.num_prompt_tokens
            if not request.device_sampled or (not outputs and request.params.n > 1):
                return False
            if seq.num_pending and (outputs >= (request.params.max_tokens or limit)
                                    or length >= limit):  # fmt: skip
                return False  # its pending token is its last
        return all(_runs_async(seq) for seq in scheduler.admissible())

    def _launch(self, sched: SchedulerOutput, previous: Launched | None) -> Launched:
        """The forward of ``sched`` and the token of each span that reaches its sequence's end,
        on the device; then each sequence counts its tokens computed and that one pending."""
        placeholders = {}
        if previous is not None:
            scheduled = previous.round.scheduled
            placeholders = {
                scheduled[i].seq.seq_id: -1 - j for j, i in enumerate(previous.samplers)
            }
        round = Round(sched.scheduled, plain_spans(sched.scheduled, placeholders))
        pending = previous.tokens if previous is not None and previous.samplers else None
        self.runner.copy_blocks(sched.blocks_to_copy)  # (copy-on-write: after the steps before it)
        logits = self.runner.forward(round.spans, pending=pending).logits
        step = sample_jobs(round, logits)
        jobs = step.jobs
        tokens = self.step_sampler.sample_decodes(logits, jobs, pending)
        logprobs = {  # of the raw rows, as the synchronous step reports them
            j: logprob_tensors(logits[j : j + 1], tokens[j : j + 1], job.params.logprobs)
            for j, job in enumerate(jobs)
            if job.params.logprobs is not None
        }
        for s in sched.scheduled:
            s.seq.num_computed_tokens = s.end
            s.seq.num_pending += s.samples
        self.launches += 1
        return Launched(round, step.owners, tokens, _to_host(tokens, logprobs))

    def _read(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens (the one host sync) and commit them."""
        round = launched.round
        results: list[list[SampleResult]] = [[] for _ in round.scheduled]
        host_tokens, host_logprobs, done = launched.on_host
        if done is not None:
            done.synchronize()
        tokens = host_tokens.tolist()
        for j, (i, token) in enumerate(zip(launched.samplers, tokens, strict=True)):
            round.scheduled[i].seq.num_pending -= 1
            figures = host_logprobs.get(j)
            logprobs = None if figures is None else logprob_entries(figures, [token])
            results[i] = [SampleResult([token], logprobs)]
        return self.commit(self.sync.spec, round, Verified(results))


def _runs_async(seq: Sequence) -> bool:
    """A waiting sequence's request reads nothing but its tokens and forks no samples."""
    request = seq.owner.request
    return request.device_sampled and request.params.n == 1


def _to_host(
    tokens: torch.Tensor, logprobs: dict[int, LogprobTensors]
) -> tuple[torch.Tensor, dict[int, LogprobTensors], torch.cuda.Event | None]:
    """``tokens`` and ``logprobs`` on the host: as they are on the CPU; on CUDA copies into
    pinned memory, queued behind the step's kernels, with an event that marks them done."""
    if not tokens.is_cuda:
        return tokens, logprobs, None

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    on_host = copy(tokens), {j: tuple(map(copy, f)) for j, f in logprobs.items()}
    done = torch.cuda.Event()
    done.record()
    return *on_host, done
