"""A step's sampling jobs (one per sample a span feeds) and where their rows lie; what a job
emits."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pagedspec.engine.sample.penalties import TokenHistory
from pagedspec.engine.sample.sampler import seeded_generator
from pagedspec.engine.sampling_params import SamplingParams


class SampleJob(NamedTuple):
    params: SamplingParams
    index: int  # which of the request's n samples
    num_outputs: int  # output tokens before this step
    token_ids: Sequence[int]  # the prompt, then those num_outputs tokens (for penalties)
    row: int  # its first row in the step's logits: 1 + len(drafts) rows are its own
    drafts: Sequence[int] = ()
    draft_probs: torch.Tensor | None = None  # q [len(drafts), V] of sampled drafts
    grammar: Any = (
        None  # the sample's matcher at its committed tokens (pagedspec.engine.sample.grammar)
    )
    grammar_bits: Any = None  # the drafter's bitmasks for rows 0 .. len(drafts) - 1, or None

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


class SampleResult(NamedTuple):
    token_ids: list[int]  # accepted drafts, then one recovered or bonus token
    logprobs: list[dict[int, float]] | None


def job_starts(jobs: list[SampleJob]) -> list[int]:
    """Each (non-empty ``jobs``) job's first row among the jobs' rows back to back."""
    return list(itertools.accumulate((job.num_rows for job in jobs[:-1]), initial=0))


def rows_of(
    rows: torch.Tensor, jobs: list[SampleJob], starts: list[int], group: list[int]
) -> torch.Tensor:
    """The rows of the jobs in ``group``, back to back."""
    index = [r for i in group for r in range(starts[i], starts[i] + jobs[i].num_rows)]
    return rows[torch.tensor(index, device=rows.device)]


def in_place(jobs: list[SampleJob]) -> bool:
    """The jobs' rows lie back to back from row 0, in order (no fork repeats a row, no leaf
    row is skipped)."""
    row = 0
    for job in jobs:
        if job.row != row:
            return False
        row += 1 + len(job.drafts)
    return True


def gather_rows(logits: torch.Tensor, jobs: list[SampleJob]) -> torch.Tensor:
    """Every job's rows, back to back: a view of ``logits`` when they already lie so, else
    one gather."""
    if in_place(jobs):
        return logits[: jobs[-1].row + jobs[-1].num_rows]
    index = [r for job in jobs for r in range(job.row, job.row + job.num_rows)]
    return logits[torch.tensor(index, device=logits.device)]


def token_history(job: SampleJob) -> TokenHistory:
    num_prompt_tokens = len(job.token_ids) - job.num_outputs
    return TokenHistory(job.params, job.token_ids, num_prompt_tokens, job.drafts, job.num_rows)


def position_generators(job: SampleJob, device: torch.device) -> list[torch.Generator | None]:
    seed = job.params.seed
    if seed is None:
        return [None] * job.num_rows  # the sampler's shared generator
    return [
        seeded_generator(device, seed, job.index, job.num_outputs + j) for j in range(job.num_rows)
    ]
