"""The round of a step: what the forward computes, and how its logit rows become tokens.

The engine runs every step through a round object and never sees a proposer, a draft tree, a
feature or a KV move:

    k        = spec.lookahead(num_busy)         # draft slots per sequence, for the scheduler
    round    = spec.prepare(sched)              # the spans (and drafts) that run
    out      = runner.forward(round.spans, round.return_hidden, hidden_layers=...)
    verified = spec.verify(round, out)          # each sample's tokens, and what commit reads
    spec.commit(round, verified, i, sample, ...)  # per committing sample: drafter state

``NoSpeculation`` (here) is the round with speculation off: the spans are the scheduled tokens,
sampled where they end. ``Speculation`` (``pagedspec.engine.spec_decode``) adds drafts to them.
``prepare`` and ``verify`` change no state: a step that fails before ``commit`` is retried or
isolated as if it never ran. The plain, speculative and async steps build their spans and
sample jobs with ``plain_spans`` and ``sample_jobs``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedspec.engine.request import SampleState
from pagedspec.engine.sample.raw_logprobs import token_logprobs
from pagedspec.engine.sample.rejection import verify_deterministic_drafts
from pagedspec.engine.sample.sample_jobs import SampleJob, SampleResult
from pagedspec.engine.sample.sampler import argmax_rows
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.engine.worker.model_runner import ForwardOutput
from pagedspec.engine.worker.spans import Span
from pagedspec.scheduler import ScheduledSequence, SchedulerOutput, Sequence

PromptLogprobs = dict[int, list[dict[int, float]]]


@dataclass(frozen=True)
class Round:
    """One step's work: ``spans[i]`` computes ``scheduled[i]`` (and its drafts)."""

    scheduled: list[ScheduledSequence]
    spans: list[Span]
    return_hidden: bool = False  # the forward returns hidden states too,
    hidden_layers: tuple[int, ...] = ()  # those of these layers before the final ones


@dataclass(frozen=True)
class Verified:
    """What ``verify`` makes of a round's forward."""

    results: list[list[SampleResult]]  # per scheduled sequence, one per sample it feeds
    # per scheduled index whose request reports prompt logprobs: its entries for the prompt
    # tokens from position start + 1 on (``Request.add_prompt_logprobs``)
    prompt_logprobs: PromptLogprobs = field(default_factory=dict)
    # per scheduled index: the drafter's features of the span's rows (None: no drafter reads them)
    features: list[torch.Tensor | None] | None = None
    # per scheduled index: the span index of a draft-tree leaf whose token was emitted
    leaf_hits: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepJobs:
    """A round's sampling jobs: ``jobs[j]`` samples for ``scheduled[owners[j]]``; span i's
    sampling rows start at ``first_rows[i]``, after its prompt-logprob rows."""

    jobs: list[SampleJob]
    owners: list[int]
    first_rows: dict[int, int]
    prompt_logprobs: PromptLogprobs


class NoSpeculation:
    """Speculation off: each span is a sequence's scheduled tokens, sampled where it ends."""

    def __init__(self, sampler: StepSampler, k: int = 0) -> None:
        self.sampler = sampler
        self.k = k
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.num_leaf_tokens = 0
        self.verifications_by_accepted = [0] * (k + 1)  # [a]: verifications that accepted a

    def lookahead(self, num_busy: int) -> int | Callable[[Sequence], int]:
        return 0

    def new_draft(self) -> Any:
        """What speculation keeps about a new sequence (``SampleState.draft``): nothing."""
        return None

    def prepare(self, sched: SchedulerOutput) -> Round:
        return Round(sched.scheduled, plain_spans(sched.scheduled))

    def verify(self, round: Round, output: ForwardOutput) -> Verified:
        """Per scheduled sequence, one result per sample it feeds (n when a prompt forks)."""
        logits = output.logits
        greedy = greedy_round(round, logits)
        if greedy is not None:
            return Verified(greedy)
        step = sample_jobs(round, logits)
        results = by_owner(len(round.scheduled), step.owners, self.sampler(logits, step.jobs))
        return Verified(results, step.prompt_logprobs)

    def commit(
        self,
        round: Round,
        verified: Verified,
        i: int,
        record: SampleState,
        emitted: int,
        kept: list[int],
    ) -> int | None:
        """``record`` (scheduled as ``round.scheduled[i]``, or a fork of it) commits ``kept``
        of the ``emitted`` tokens the step gave it; returns how many of its tokens a drafter's
        KV covers (None: no drafter KV), capping what prefix caching may register."""
        return None

    def reset(self, record: SampleState) -> None:
        """The sequence lost its blocks (preemption): whatever a drafter kept is gone."""

    def stats(self) -> dict[str, Any]:
        return dict(
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_verifications=self.num_verifications,
            num_leaf_tokens=self.num_leaf_tokens,
            accepted_by_position=tuple(  # verifications that accepted more than j drafts
                sum(self.verifications_by_accepted[j + 1 :]) for j in range(self.k)
            ),
        )


def plain_spans(
    scheduled: list[ScheduledSequence], placeholders: dict[int, int] | None = None
) -> list[Span]:
    """Each sequence's scheduled tokens, with its logit rows (``logit_rows``). Under async
    scheduling a sequence whose last token is still on the device names it by its placeholder
    (``placeholders[seq_id]``, ``pagedspec.engine.worker.spans.with_pending``)."""
    new = tuple.__new__  # Span(...) runs a Python __new__: a third of a decode span's cost
    if not placeholders:
        return [new(Span, (s.seq.token_ids[s.start : s.end], s.start, logit_rows(s),
                           s.block_table, None)) for s in scheduled]  # fmt: skip
    return [
        new(Span, ([placeholders[s.seq.seq_id]] if s.seq.num_pending else
                   s.seq.token_ids[s.start : s.end], s.start, logit_rows(s), s.block_table, None))
        for s in scheduled
    ]  # fmt: skip


def sample_jobs(
    round: Round,
    logits: torch.Tensor,
    drafts: Seq[Seq[int]] | None = None,
    draft_probs: Seq[torch.Tensor | None] | None = None,
    grammar_bits: dict[int, np.ndarray] | None = None,
) -> StepJobs:
    """One job per sample each sampling span feeds (a finished prompt feeds all n), verifying
    ``drafts[i]`` (with q ``draft_probs[i]`` where sampled, and the drafter's
    ``grammar_bits[i]``); the prompt logprobs of the rows before them. A sequence's output
    count includes a token still pending on the device, and penalties count it by its
    placeholder."""
    jobs, owners, first_rows, prompt_logprobs = [], [], {}, {}
    row = 0
    for i, (s, span) in enumerate(zip(round.scheduled, round.spans, strict=True)):
        if not span.num_logits:
            continue
        seq = s.seq
        record: SampleState = seq.owner
        params = record.request.params
        first = row
        if record.request.prompt_logprobs is not None and (n := prompt_rows(s)):
            predicted = seq.token_ids[s.start + 1 : s.start + 1 + n]
            prompt_logprobs[i] = token_logprobs(logits[row : row + n], predicted,
                                                params.prompt_logprobs)  # fmt: skip
            first += n
        first_rows[i] = first
        row += span.num_logits
        if not s.samples:  # a prompt chunk that only reports prompt logprobs
            continue
        outputs = len(seq.token_ids) + seq.num_pending - seq.num_prompt_tokens
        history = seq.token_ids
        if seq.num_pending and params.has_penalties:
            history = [*history, *span.token_ids[-seq.num_pending :]]
        d = drafts[i] if drafts is not None else ()
        q = draft_probs[i] if draft_probs is not None else None
        bits = grammar_bits.get(i) if grammar_bits else None
        for index in (record.index,) if outputs else range(params.n):
            jobs.append(SampleJob(params, index, outputs, history, first, d, q, record.grammar,
                                  bits))  # fmt: skip
            owners.append(i)
    return StepJobs(jobs, owners, first_rows, prompt_logprobs)


def greedy_round(
    round: Round, logits: torch.Tensor, drafts: list[list[int]] | None = None
) -> list[list[SampleResult]] | None:
    """The round's results where every sampling span is a greedy decode with greedy drafts
    (``drafts``) or none and no draft tree: each row's argmax, the drafts matched against it,
    in one pass (no sampling jobs); None where some span needs more (a fork, sampling,
    penalties, min_tokens, logprobs)."""
    starts, owners, row = [], [], 0
    for i, (s, span) in enumerate(zip(round.scheduled, round.spans, strict=True)):
        if not span.num_logits:
            continue
        seq = s.seq
        outputs = len(seq.token_ids) - seq.num_prompt_tokens
        if not outputs or outputs < seq.owner.request.greedy_from:
            return None
        starts.append(row)
        owners.append(i)
        row += span.num_logits
    samples = argmax_rows(logits[:row]).tolist()
    new = tuple.__new__  # (as in plain_spans)
    if drafts:
        emitted = verify_deterministic_drafts(samples, [drafts[i] for i in owners], starts)
    else:  # one row per span: its sample
        emitted = [[token] for token in samples]
    if len(owners) == len(round.scheduled):  # every span samples: no grouping to do
        return [[new(SampleResult, (e, None))] for e in emitted]
    return by_owner(len(round.scheduled), owners, [new(SampleResult, (e, None)) for e in emitted])


def prompt_rows(s: ScheduledSequence) -> int:
    """Rows of ``s``'s span that predict prompt tokens, kept for a request that reports prompt
    logprobs and does not have them all yet: positions start .. min(end, prompt) - 2."""
    request = s.seq.owner.request
    if request.prompt_logprobs is None or len(request.prompt_logprobs) >= s.seq.num_prompt_tokens:
        return 0
    return max(0, min(s.end, s.seq.num_prompt_tokens - 1) - s.start)


def logit_rows(s: ScheduledSequence, drafts: int = 0) -> int:
    """The span's logit rows (its last tokens'): prompt rows, then the sampling row and one
    per draft where the step samples."""
    rows = 1 + drafts if s.samples else 0
    return rows if s.seq.owner.request.prompt_logprobs is None else rows + prompt_rows(s)


def by_owner(num: int, owners: list[int], results: list[SampleResult]) -> list[list[SampleResult]]:
    grouped: list[list[SampleResult]] = [[] for _ in range(num)]
    for i, result in zip(owners, results, strict=True):
        grouped[i].append(result)
    return grouped
