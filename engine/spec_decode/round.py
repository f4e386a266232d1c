"""Speculation as one plug-in round of the engine step.

The engine runs every step through one of these objects and never sees a proposer, a draft
tree, a feature or a KV move:

    k     = spec.lookahead(num_busy)           # draft slots per sequence, for the scheduler
    round = spec.prepare(sched)                # drafts, and the spans that verify them
    out   = runner.forward(round.spans, **round.forward_options)
    res   = spec.verify(round, out)            # sample, or verify drafts (and leaves)
    spec.commit(round, i, sample, ...)         # per committing sample: backoff, drafter state

``NoSpeculation`` is the round with speculation off (the spans are the scheduled tokens,
sampled where they end); ``Speculation`` wraps a proposer (n-gram, draft model or EAGLE head).
``prepare`` and ``verify`` change no state: a step that fails before ``commit`` is retried or
isolated as if it never ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.raw_logprobs import token_logprobs
from engine.request import SampleState
from engine.sample_jobs import SampleJob, SampleResult
from engine.sampler import argmax_rows
from engine.spans import Span
from engine.spec_decode.proposers import Proposal
from engine.spec_decode.rejection import verify_deterministic_drafts
from engine.step_sampler import StepSampler
from scheduler import ScheduledSequence, SchedulerOutput, Sequence

NO_PROPOSAL = Proposal([], [], {})


@dataclasses.dataclass
class Round:
    """One step's work: ``spans[i]`` computes ``scheduled[i]`` (and its drafts)."""

    scheduled: list[ScheduledSequence]
    spans: list[Span]
    proposal: Proposal = NO_PROPOSAL
    forward_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # set by verify: per scheduled index, the drafter's features of the span's rows (or None),
    # and the span index of a draft-tree leaf whose token was emitted
    features: list[torch.Tensor | None] | None = None
    leaf_hits: dict[int, int] = dataclasses.field(default_factory=dict)
    # set by verify: per scheduled index whose request reports prompt logprobs, its entries for
    # the prompt tokens from position start + 1 on (engine.request.Request.add_prompt_logprobs)
    prompt_logprobs: dict[int, list[dict[int, float]]] = dataclasses.field(default_factory=dict)


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

    def prepare(self, sched: SchedulerOutput) -> Round:
        new = tuple.__new__  # Span(...) runs a Python __new__: a third of a decode span's cost
        spans = [
            new(
                Span,
                (s.seq.token_ids[s.start : s.end], s.start, logit_rows(s), s.block_table, None),
            )
            for s in sched.scheduled
        ]
        return Round(sched.scheduled, spans)

    def verify(self, round: Round, output: Any) -> list[list[SampleResult]]:
        """Per scheduled sequence, one result per sample it feeds (n when a prompt forks)."""
        greedy = greedy_round(round, output)
        if greedy is not None:
            return greedy
        jobs, owners = [], []
        row = 0
        for i, (s, span) in enumerate(zip(round.scheduled, round.spans, strict=True)):
            if not span.num_logits:
                continue
            record: SampleState = s.seq.owner
            params, outputs = record.request.params, len(s.seq.token_ids) - s.seq.num_prompt_tokens
            sampling_row = row + keep_prompt_logprobs(round, i, output, row)
            row += span.num_logits
            if not s.samples:  # a prompt chunk that only reports prompt logprobs
                continue
            # (a finished prompt feeds all n samples at once)
            for index in (record.index,) if outputs else range(params.n):
                jobs.append(SampleJob(params, index, outputs, s.seq.token_ids, sampling_row,
                                      grammar=record.grammar))  # fmt: skip
                owners.append(i)
        return by_owner(len(round.scheduled), owners, self.sampler(output, jobs))

    def commit(
        self, round: Round, i: int, record: SampleState, emitted: int, kept: list[int]
    ) -> int | None:
        """``record`` (scheduled as ``round.scheduled[i]``, or a fork of it) commits ``kept``
        of the ``emitted`` tokens the step gave it; returns how many of its tokens a drafter's
        KV covers (None: no drafter KV), capping what prefix caching may register."""
        return None

    def reset(self, record: SampleState) -> None:
        """The sequence lost its blocks (preemption): whatever a drafter kept is gone."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        pass

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


def greedy_round(round: Round, logits: torch.Tensor) -> list[list[SampleResult]] | None:
    """The round's results where every sampling span is a greedy decode with greedy drafts or
    none and no draft tree: each row's argmax, the drafts matched against it, in one pass
    (no sampling jobs); None where some span needs more (a fork, sampling, penalties,
    min_tokens, logprobs)."""
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
    drafts = round.proposal.drafts
    new = tuple.__new__  # (as in NoSpeculation.prepare)
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


def keep_prompt_logprobs(round: Round, i: int, logits: torch.Tensor, row: int) -> int:
    """Record span i's prompt logprobs (its rows from ``row``) in the round; returns how many
    rows they took (its sampling rows follow)."""
    s = round.scheduled[i]
    n = prompt_rows(s)
    if n:
        k = s.seq.owner.request.params.prompt_logprobs
        predicted = s.seq.token_ids[s.start + 1 : s.start + 1 + n]
        round.prompt_logprobs[i] = token_logprobs(logits[row : row + n], predicted, k)
    return n


def by_owner(num: int, owners: list[int], results: list[SampleResult]) -> list[list[SampleResult]]:
    grouped: list[list[SampleResult]] = [[] for _ in range(num)]
    for i, result in zip(owners, results, strict=True):
        grouped[i].append(result)
    return grouped
