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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.penalties import TokenHistory, apply_penalties
from engine.sampler import Sampler, SamplingBatch, argmax_rows, processed_probs, token_logprobs
from engine.sampling_params import SamplingParams
from engine.spec_decode.rejection import rejection_sample

Verify = Callable[[Sequence[int], Sequence[Sequence[int]], Sequence[int]], list[list[int]]]


@dataclass(frozen=True)
class SampleJob:
    params: SamplingParams
    index: int  # which of the request's n samples
    num_outputs: int  # output tokens before this step
    token_ids: Sequence[int]  # the prompt, then those num_outputs tokens (for penalties)
    rows: torch.Tensor  # float32 [1 + len(drafts), V] of the target's logits
    drafts: Sequence[int]
    draft_probs: torch.Tensor | None = None  # q [len(drafts), V] of sampled drafts


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]  # accepted drafts, then one recovered or bonus token
    logprobs: list[dict[int, float]] | None


class StepSampler:
    def __init__(self, sampler: Sampler, eos_token_ids: set[int], verify: Verify) -> None:
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.verify = verify

    def __call__(self, jobs: list[SampleJob]) -> list[SampleResult]:
        sampled = [i for i, job in enumerate(jobs) if job.draft_probs is not None and job.drafts]
        plain = sorted(set(range(len(jobs))) - set(sampled))
        tokens: list[list[int]] = [[] for _ in jobs]
        for i, emitted in zip(plain, self._sample_and_match([jobs[i] for i in plain]), strict=True):
            tokens[i] = emitted
        for i, emitted in zip(sampled, self._rejection([jobs[i] for i in sampled]), strict=True):
            tokens[i] = emitted
        # logprobs are of the raw rows: before min_tokens masking, penalties and temperature
        return [
            SampleResult(
                emitted,
                None
                if job.params.logprobs is None
                else token_logprobs(job.rows, emitted, job.params.logprobs),
            )
            for job, emitted in zip(jobs, tokens, strict=True)
        ]

    def _batch(self, jobs: list[SampleJob]) -> tuple[torch.Tensor, SamplingBatch, list[int]]:
        """Every row of every job, masked for min_tokens and penalised (row j of a span counts
        drafts[:j] as generated), with its sampling parameters."""
        starts, rows, params, generators = [], [], [], []
        for job in jobs:
            starts.append(len(params))
            rows.append(self._mask_min_tokens(job))
            params.extend([job.params] * job.rows.shape[0])
            generators.extend(_position_generators(job))
        logits = concat_rows(rows)
        if any(job.params.has_penalties for job in jobs):  # else no work at all
            logits = apply_penalties(logits, [_history(job) for job in jobs])
        batch = SamplingBatch.from_params(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            generators=generators,
            device=logits.device,
        )
        return logits, batch, starts

    def _sample_and_match(self, jobs: list[SampleJob]) -> list[list[int]]:
        """Deterministic drafts: one target sample per row; a draft is accepted iff equal."""
        if not jobs:
            return []
        if all(job.params.temperature == 0 and not job.params.has_penalties for job in jobs):
            # Greedy fast path (what the sampler computes for an all-greedy batch, which draws
            # nothing): the argmax of each row, without building sampling parameters or
            # generators; a batch-1 decode step spent ~0.2 ms in those.
            starts = list(accumulate((job.rows.shape[0] for job in jobs[:-1]), initial=0))
            logits = concat_rows([self._mask_min_tokens(job) for job in jobs])
            samples = argmax_rows(logits).tolist()
        else:
            logits, batch, starts = self._batch(jobs)
            samples = self.sampler(logits, batch).tolist()
        return self.verify(samples, [job.drafts for job in jobs], starts)

    def _rejection(self, jobs: list[SampleJob]) -> list[list[int]]:
        """Sampled drafts: accept x with min(1, p(x)/q(x)), else resample norm(max(0, p - q)).

        A seeded job is verified on its own: how many uniforms a row draws depends on the
        batch's largest draft count, and a seeded row must draw the same whatever its batch.
        """
        unseeded = [i for i, job in enumerate(jobs) if job.params.seed is None]
        groups = [[i] for i, job in enumerate(jobs) if job.params.seed is not None]
        tokens: list[list[int]] = [[] for _ in jobs]
        for group in groups + ([unseeded] if unseeded else []):
            for i, emitted in zip(group, self._verify_group([jobs[i] for i in group]), strict=True):
                tokens[i] = emitted
        return tokens

    def _verify_group(self, jobs: list[SampleJob]) -> list[list[int]]:
        logits, batch, starts = self._batch(jobs)
        p = processed_probs(logits, batch)
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
        seed = jobs[0].params.seed
        generator = self.sampler.generator if seed is None else _round_generator(jobs[0])
        out = rejection_sample(
            target,
            drafts.to(p.device),
            q,
            torch.tensor([len(job.drafts) for job in jobs], device=p.device),
            generator,
        )
        return [[t for t in row if t >= 0] for row in out.tolist()]

    def _mask_min_tokens(self, job: SampleJob) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop token ids cannot be sampled (row j of a
        span is output number num_outputs + j). Logprobs still come from the raw rows."""
        short = job.params.min_tokens - job.num_outputs
        if short <= 0:
            return job.rows
        banned = list(self.eos_token_ids | set(job.params.stop_token_ids))
        rows = job.rows.clone()
        rows[:short, banned] = float("-inf")
        return rows


def _history(job: SampleJob) -> TokenHistory:
    num_prompt_tokens = len(job.token_ids) - job.num_outputs
    return TokenHistory(job.params, job.token_ids, num_prompt_tokens, job.drafts, job.rows.shape[0])


def _round_generator(job: SampleJob) -> torch.Generator:
    """A seeded sample's randomness for one verification round."""
    return torch.Generator(device=job.rows.device).manual_seed(
        hash((job.params.seed, job.index, job.num_outputs, 1)) & 0x7FFF_FFFF_FFFF_FFFF
    )


def _position_generators(job: SampleJob) -> list[torch.Generator | None]:
    seed = job.params.seed
    if seed is None:
        return [None] * job.rows.shape[0]  # the sampler's shared generator
    device = job.rows.device
    return [
        torch.Generator(device=device).manual_seed(
            hash((seed, job.index, job.num_outputs + j)) & 0x7FFF_FFFF_FFFF_FFFF
        )
        for j in range(job.rows.shape[0])
    ]


def concat_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(rows) of 2-D row blocks, as a view when they already lie back to back in one
    tensor (every step without n > 1 forks or min_tokens masking): no copy of B x vocab floats."""
    first = rows[0]
    offset = first.storage_offset()
    for r in rows:
        if (
            r.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or r.storage_offset() != offset
            or not r.is_contiguous()
        ):
            return torch.cat(rows)
        offset += r.numel()
    width = first.shape[1]
    return first.as_strided((sum(r.shape[0] for r in rows), width), (width, 1))
