"""From one step's logit rows to the tokens each sample emits.

Every sampling span verifies its drafts (zero or more): row j of a span is the target's
distribution at draft position j, the last row the bonus position. A plain decode is the case
with no drafts. Seeded samples draw output position i from a generator seeded by (seed, sample
index, i) alone, so their tokens do not depend on the batch, on preemption, or on whether
speculation drafted them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampler import Sampler, SamplingBatch, token_logprobs
from engine.sampling_params import SamplingParams

Verify = Callable[[Sequence[int], Sequence[Sequence[int]], Sequence[int]], list[list[int]]]


@dataclass(frozen=True)
class SampleJob:
    params: SamplingParams
    index: int  # which of the request's n samples
    num_outputs: int  # output tokens before this step
    rows: torch.Tensor  # float32 [1 + len(drafts), V] of the target's logits
    drafts: Sequence[int]


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
        if not jobs:
            return []
        starts, rows, params, generators = [], [], [], []
        for job in jobs:
            starts.append(len(params))
            rows.append(self._mask_min_tokens(job))
            params.extend([job.params] * job.rows.shape[0])
            generators.extend(_position_generators(job))
        logits = concat_rows(rows)
        batch = SamplingBatch.from_params(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            generators=generators,
            device=logits.device,
        )
        samples = self.sampler(logits, batch).tolist()
        emitted = self.verify(samples, [job.drafts for job in jobs], starts)
        return [
            SampleResult(
                tokens,
                None
                if job.params.logprobs is None
                else token_logprobs(job.rows, tokens, job.params.logprobs),
            )
            for job, tokens in zip(jobs, emitted, strict=True)
        ]

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
