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

import math

import numpy as np
import torch

from pagedspec.engine.sample.grammar import BitmaskFiller, refused, words
from pagedspec.engine.sample.penalties import apply_penalties
from pagedspec.engine.sample.raw_logprobs import token_logprobs
from pagedspec.engine.sample.rejection import rejection_sample, verify_deterministic_drafts
from pagedspec.engine.sample.sample_jobs import (
    SampleJob,
    SampleResult,
    gather_rows,
    job_starts,
    position_generators,
    rows_of,
    token_history,
)
from pagedspec.engine.sample.sampler import (
    Sampler,
    SamplingBatch,
    argmax_rows,
    processed_probs,
    seeded_generator,
)


class StepSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: set[int], threads: int = 1) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.bitmasks = BitmaskFiller(threads)  # constrained rows' masks

    def __call__(self, logits: torch.Tensor, jobs: list[SampleJob]) -> list[SampleResult]:
        """Each job's tokens from its rows of ``logits`` (float32 [rows, V])."""
        if not jobs:
            return []
        starts = job_starts(jobs)
        raw = gather_rows(logits, jobs)
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
                sub = rows_of(rows, jobs, starts, group)
                for i, emitted in zip(group, verify(sub, picked, job_starts(picked)), strict=True):
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
        placeholders for ``pending`` tokens (``pagedspec.engine.worker.spans.with_pending``):
        penalties count them."""
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
            generators.extend(position_generators(job, logits.device))
        if any(job.params.has_penalties for job in jobs):  # else no work at all
            logits = apply_penalties(logits, [token_history(job) for job in jobs], pending=pending)
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
            sub = rows_of(rows, jobs, starts, group)
            for i, emitted in zip(group, self._verify_group(sub, picked), strict=True):
                tokens[i] = emitted
        return tokens

    def _verify_group(self, rows: torch.Tensor, jobs: list[SampleJob]) -> list[list[int]]:
        logits, batch = self._batch(rows, jobs)
        p = processed_probs(logits, batch)
        starts = job_starts(jobs)
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
    offsets = job_starts([job for job, _ in constrained])
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
