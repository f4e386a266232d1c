"""From one step's logit rows to the tokens each sample emits.

Every sampling span verifies its drafts (zero or more): row j of a span is the target's
distribution at draft position j, the last row the bonus position. A plain decode is the case
with no drafts.

Deterministic drafts (n-gram, greedy) are verified by drawing one target sample per row and
accepting a draft iff it equals the sample: a seeded sample draws output position i from a
generator seeded by (seed, sample index, i) alone, so its tokens do not depend on the batch, on
preemption, or on whether speculation drafted them. Sampled drafts (with their q) go through
``rejection_sample``: the output law is still exactly the target's, but a seeded request's
tokens then depend on what was drafted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.grammar import BitmaskFiller, refused, words
from engine.penalties import TokenHistory, apply_penalties
from engine.sampler import (
    Sampler,
    SamplingBatch,
    argmax_rows,
    processed_probs,
    seeded_generator,
    token_logprobs,
)
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection import rejection_sample, verify_deterministic_drafts


class SampleJob(NamedTuple):
    params: SamplingParams
    index: int  # which of the request's n samples
    num_outputs: int  # output tokens before this step
    token_ids: Sequence[int]  # the prompt, then those num_outputs tokens (for penalties)
    row: int  # its first row in the step's logits: 1 + len(drafts) rows are its own
    drafts: Sequence[int] = ()
    draft_probs: torch.Tensor | None = None  # q [len(drafts), V] of sampled drafts
    grammar: Any = None  # the sample's matcher at its committed tokens (engine.grammar)
    grammar_bits: Any = None  # the drafter's bitmasks for rows 0 .. len(drafts) - 1, or None

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


class SampleResult(NamedTuple):
    token_ids: list[int]  # accepted drafts, then one recovered or bonus token
    logprobs: list[dict[int, float]] | None


class StepSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: set[int], threads: int = 1) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.bitmasks = BitmaskFiller(threads)  # constrained rows' masks

    def __call__(self, logits: torch.Tensor, jobs: list[SampleJob]) -> list[SampleResult]:
        """Each job's tokens from its rows of ``logits`` (float32 [rows, V])."""
        if not jobs:
            return []
        starts = _starts(jobs)
        raw = _gather_rows(logits, jobs)
        rows = self._mask_min_tokens(raw, jobs)
        rows = _mask_grammar(rows, raw, jobs, starts, self.bitmasks)
        sampled = [i for i, job in enumerate(jobs) if job.draft_probs is not None and job.drafts]
        if not sampled:
            tokens = self._sample_and_match(rows, jobs, starts)
        else:
            tokens: list[list[int]] = [[] for _ in jobs]
            plain = sorted(set(range(len(jobs))) - set(sampled))
            for group, verify in ((plain, self._sample_and_match), (sampled, self._rejection)):
                if not group:
                    continue
                picked = [jobs[i] for i in group]
                sub = _rows_of(rows, jobs, starts, group)
                for i, emitted in zip(group, verify(sub, picked, _starts(picked)), strict=True):
                    tokens[i] = emitted
        # logprobs are of the raw rows: before min_tokens masking, penalties and temperature
        return [
            SampleResult(
                emitted,
                None
                if job.params.logprobs is None
                else token_logprobs(
                    raw[start : start + job.num_rows], emitted, job.params.logprobs
                ),
            )
            for job, emitted, start in zip(jobs, tokens, starts, strict=True)
        ]

    def sample_decodes(
        self, logits: torch.Tensor, jobs: list[SampleJob], pending: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The token of each job, row i (one row, no drafts or constraint), left on the device:
        what ``__call__`` emits for these jobs, unread. A job's ``token_ids`` may end with
        placeholders for ``pending`` tokens (``engine.spans.with_pending``): penalties count
        them."""
        return self._samples(self._mask_min_tokens(logits, jobs), jobs, pending)

    def _samples(
        self, rows: torch.Tensor, jobs: list[SampleJob], pending: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One target sample per row, on the device. Greedy rows (also where there are no
        jobs: a step of prompt chunks) are each row's argmax, what the sampler computes for an
        all-greedy batch, which draws nothing, without building sampling parameters or
        generators."""
        if all(job.params.temperature == 0 and not job.params.has_penalties for job in jobs):
            return argmax_rows(rows)
        return self.sampler(*self._batch(rows, jobs, pending))

    def _batch(
        self, logits: torch.Tensor, jobs: list[SampleJob], pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SamplingBatch]:
        """The jobs' rows penalised (row j of a span counts drafts[:j] as generated), with
        their sampling parameters."""
        params, generators = [], []
        for job in jobs:
            params.extend([job.params] * job.num_rows)
            generators.extend(_position_generators(job, logits.device))
        if any(job.params.has_penalties for job in jobs):  # else no work at all
            logits = apply_penalties(logits, [_history(job) for job in jobs], pending=pending)
        batch = SamplingBatch.from_params(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            generators=generators,
            device=logits.device,
        )
        return logits, batch

    def _sample_and_match(
        self, rows: torch.Tensor, jobs: list[SampleJob], starts: list[int]
    ) -> list[list[int]]:
        """Deterministic drafts: one target sample per row; a draft is accepted iff equal."""
        samples = self._samples(rows, jobs).tolist()
        return verify_deterministic_drafts(samples, [job.drafts for job in jobs], starts)

    def _rejection(
        self, rows: torch.Tensor, jobs: list[SampleJob], starts: list[int]
    ) -> list[list[int]]:
        """Sampled drafts: accept x with min(1, p(x)/q(x)), else resample norm(max(0, p - q)).

        A seeded job is verified on its own: how many uniforms a row draws depends on the
        batch's largest draft count, and a seeded row must draw the same whatever its batch.
        """
        unseeded = [i for i, job in enumerate(jobs) if job.params.seed is None]
        groups = [[i] for i, job in enumerate(jobs) if job.params.seed is not None]
        tokens: list[list[int]] = [[] for _ in jobs]
        for group in groups + ([unseeded] if unseeded else []):
            picked = [jobs[i] for i in group]
            sub = _rows_of(rows, jobs, starts, group)
            for i, emitted in zip(group, self._verify_group(sub, picked), strict=True):
                tokens[i] = emitted
        return tokens

    def _verify_group(self, rows: torch.Tensor, jobs: list[SampleJob]) -> list[list[int]]:
        logits, batch = self._batch(rows, jobs)
        p = processed_probs(logits, batch)
        starts = _starts(jobs)
        k = max(len(job.drafts) for job in jobs)
        if all(len(job.drafts) == k for job in jobs):  # no padding: p's rows as they lie
            target = p.view(len(jobs), k + 1, p.shape[-1])
            q = torch.stack([job.draft_probs for job in jobs])
            drafts = torch.tensor([list(job.drafts) for job in jobs])
        else:
            target = p.new_zeros(len(jobs), k + 1, p.shape[-1])
            q = p.new_zeros(len(jobs), k, p.shape[-1])
            drafts = torch.zeros(len(jobs), k, dtype=torch.long)
            for s, (job, start) in enumerate(zip(jobs, starts, strict=True)):
                n = len(job.drafts)
                target[s, : n + 1] = p[start : start + n + 1]
                q[s, :n] = job.draft_probs
                drafts[s, :n] = torch.tensor(job.drafts)
        job = jobs[0]
        generator = (
            self.sampler.generator
            if job.params.seed is None
            else seeded_generator(p.device, job.params.seed, job.index, job.num_outputs, 1)
        )
        out = rejection_sample(
            target,
            drafts.to(p.device),
            q,
            torch.tensor([len(job.drafts) for job in jobs], device=p.device),
            generator,
        )
        return [[t for t in row if t >= 0] for row in out.tolist()]

    def _mask_min_tokens(self, rows: torch.Tensor, jobs: list[SampleJob]) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop token ids cannot be sampled (row j of a
        job is output number num_outputs + j): a masked copy of ``rows`` where any job is
        short; logprobs still come from the raw rows."""
        masked, start = None, 0
        for job in jobs:
            short = min(job.params.min_tokens - job.num_outputs, job.num_rows)
            if short > 0:
                masked = rows.clone() if masked is None else masked
                banned = list(self.eos_token_ids | set(job.params.stop_token_ids))
                masked[start : start + short, banned] = float("-inf")
            start += job.num_rows
        return rows if masked is None else masked


NEVER_GREEDY = 1 << 62  # greedy_from of a request that is never plain greedy


def greedy_from(params: SamplingParams) -> int:
    """The output count from which a sample's row is plain greedy: a greedy row with nothing
    that changes its argmax or asks for more (penalties, min_tokens not yet reached, a
    constraint, logprobs), so its token is the row's argmax and only that; NEVER_GREEDY if
    that never holds."""
    if (
        params.temperature
        or params.logprobs is not None
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.structured_outputs is not None
    ):
        return NEVER_GREEDY
    return params.min_tokens


def _mask_grammar(
    rows: torch.Tensor,
    raw: torch.Tensor,
    jobs: list[SampleJob],
    starts: list[int],
    bitmasks: BitmaskFiller,
) -> torch.Tensor:
    """Each constrained job's rows with what its grammar refuses at -inf (row j: after
    drafts[:j]), in place unless a constrained job reports logprobs (of the raw rows: then a
    copy). The bitmasks of every constrained row are filled, unpacked and applied at once.
    Where a min_tokens or stop-token ban left a row nothing its grammar allows (a complete
    constraint allows only EOS), the grammar wins: the row is ``raw``'s, masked by it alone."""
    constrained = [(job, start) for job, start in zip(jobs, starts, strict=True) if job.grammar]
    if not constrained:
        return rows
    banned = rows is not raw  # (_mask_min_tokens made a copy)
    total = sum(job.num_rows for job, _ in constrained)
    bits = np.empty((total, words(rows.shape[-1])), np.int32)
    bitmasks.fill([(job.grammar, job.drafts, job.grammar_bits) for job, _ in constrained], bits)
    bad = refused(bits, rows.shape[-1]).to(rows.device)
    if rows is raw and any(job.params.logprobs is not None for job, _ in constrained):
        rows = rows.clone()
    offsets = _starts([job for job, _ in constrained])
    first = constrained[0][1]
    with torch.inference_mode():  # the forward's logits are inference tensors
        if all(start == first + at for (_, start), at in zip(constrained, offsets, strict=True)):
            spans = [(first, total, 0)]  # back to back: one call
        else:
            spans = [
                (start, job.num_rows, at)
                for (job, start), at in zip(constrained, offsets, strict=True)
            ]
        for start, n, at in spans:
            rows[start : start + n].masked_fill_(bad[at : at + n], -math.inf)
            if banned and (dead := torch.isneginf(rows[start : start + n]).all(-1)).any():
                keep = raw[start : start + n][dead].masked_fill(bad[at : at + n][dead], -math.inf)
                rows[start : start + n][dead] = keep
    return rows


def _starts(jobs: list[SampleJob]) -> list[int]:
    """Each (non-empty ``jobs``) job's first row among the jobs' rows back to back."""
    return list(itertools.accumulate((job.num_rows for job in jobs[:-1]), initial=0))


def _rows_of(
    rows: torch.Tensor, jobs: list[SampleJob], starts: list[int], group: list[int]
) -> torch.Tensor:
    """The rows of the jobs in ``group``, back to back."""
    index = [r for i in group for r in range(starts[i], starts[i] + jobs[i].num_rows)]
    return rows[torch.tensor(index, device=rows.device)]


def _in_place(jobs: list[SampleJob]) -> bool:
    """The jobs' rows lie back to back from row 0, in order (no fork repeats a row, no leaf
    row is skipped)."""
    row = 0
    for job in jobs:
        if job.row != row:
            return False
        row += 1 + len(job.drafts)
    return True


def _gather_rows(logits: torch.Tensor, jobs: list[SampleJob]) -> torch.Tensor:
    """Every job's rows, back to back: a view of ``logits`` when they already lie so, else
    one gather."""
    if _in_place(jobs):
        return logits[: jobs[-1].row + jobs[-1].num_rows]
    index = [r for job in jobs for r in range(job.row, job.row + job.num_rows)]
    return logits[torch.tensor(index, device=logits.device)]


def _history(job: SampleJob) -> TokenHistory:
    num_prompt_tokens = len(job.token_ids) - job.num_outputs
    return TokenHistory(job.params, job.token_ids, num_prompt_tokens, job.drafts, job.num_rows)


def _position_generators(job: SampleJob, device: torch.device) -> list[torch.Generator | None]:
    seed = job.params.seed
    if seed is None:
        return [None] * job.num_rows  # the sampler's shared generator
    return [
        seeded_generator(device, seed, job.index, job.num_outputs + j) for j in range(job.num_rows)
    ]
