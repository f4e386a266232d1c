"""StepSampler: the greedy fast path (argmax of the rows, no sampling batch) against the
sampler, and sampled drafts handed to rejection_sample row for row."""

import pytest
import torch

from pagedspec.engine.sample.rejection import rejection_sample
from pagedspec.engine.sample.sample_jobs import SampleJob
from pagedspec.engine.sample.sampler import Sampler
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.engine.sampling_params import SamplingParams

EOS = 3


def step_sampler() -> StepSampler:
    return StepSampler(Sampler(seed=0), {EOS})


def first_max(row: torch.Tensor) -> int:
    """The lowest id holding the row's maximum (torch.argmax's tie rule), by plain Python."""
    values = row.tolist()
    return values.index(max(values))


def test_greedy_jobs_take_the_argmax_without_a_sampling_batch(gen, monkeypatch):
    """Drafts accepted while they equal the row's argmax, min_tokens masking EOS and stop ids
    first, ties going to the lowest id, seeded and unseeded alike; ``_batch`` (the sampling
    parameters and generators) is never built."""
    monkeypatch.setattr(StepSampler, "_batch", lambda *a: pytest.fail("built a sampling batch"))
    vocab = 16
    logits = torch.randn(6, vocab, generator=gen)
    logits[0, [EOS, 9]] = 50.0  # a tie, and EOS on top: banned while under min_tokens
    logits[3, [5, 11]] = 40.0
    top = [first_max(row) for row in logits]
    # rows: job 0 rows 0-2, job 1 row 0 (again: a fork), job 2 row 3, job 3 rows 4-5
    jobs = [
        # 2 drafts: the first one right, the second wrong -> [draft 0, argmax of row 1]
        SampleJob(SamplingParams(temperature=0), 0, 4, [1, 2], 0, [top[0], 15 - top[1]]),
        # min_tokens not reached: EOS (and stop id 9) masked in its one row
        SampleJob(
            SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[9], seed=7),
            0,
            1,
            [1],
            0,
            [],
        ),  # fmt: skip
        SampleJob(SamplingParams(temperature=0, seed=1), 0, 0, [1], 3, []),
        # every draft accepted: the bonus row's argmax follows
        SampleJob(SamplingParams(temperature=0), 0, 2, [1], 4, [top[4]]),
    ]
    masked = logits[0].clone()
    masked[[EOS, 9]] = float("-inf")
    expected = [[top[0], top[1]], [first_max(masked)], [5], [top[4], top[5]]]
    results = step_sampler()(logits, jobs)
    assert [r.token_ids for r in results] == expected
    assert all(r.logprobs is None for r in results)


def test_greedy_with_penalties_goes_through_the_penalised_sampler(gen):
    """A repetition penalty can move a greedy argmax: such jobs are not on the fast path."""
    logits = torch.zeros(1, 8)
    logits[0, 4], logits[0, 6] = 3.0, 2.0
    history = [1, 4]  # token 4 was generated: penalised 3.0 / 2 = 1.5 < 2.0
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    (result,) = step_sampler()(logits, [SampleJob(params, 0, 1, history, 0, [])])
    assert result.token_ids == [6]
    (plain,) = step_sampler()(logits, [SampleJob(SamplingParams(temperature=0), 0, 1, history, 0)])
    assert plain.token_ids == [4]


@pytest.mark.parametrize("counts", [(2, 2, 2), (2, 1, 3, 3, 1, 2)])
def test_sampled_drafts_reach_rejection_sample_row_for_row(gen, counts):
    """A group of sampled-draft jobs (equal draft counts: p's rows as they lie; unequal: padded)
    is verified exactly as ``rejection_sample`` verifies the same p, q and drafts padded by hand,
    with the sampler's generator."""
    vocab, k = 8, max(counts)
    logits = [torch.randn(n + 1, vocab, generator=gen) * 2 for n in counts]
    q = [(torch.randn(n, vocab, generator=gen) * 3).softmax(-1) for n in counts]
    drafts = [torch.multinomial(rows, 1, generator=gen).view(-1).tolist() for rows in q]
    params = SamplingParams(temperature=1.0)
    starts = [sum(counts[:s]) + s for s in range(len(counts))]
    jobs = [SampleJob(params, 0, 1, [1], *args) for args in zip(starts, drafts, q, strict=True)]
    target = torch.zeros(len(counts), k + 1, vocab)
    draft_probs = torch.zeros(len(counts), k, vocab)
    draft_ids = torch.zeros(len(counts), k, dtype=torch.long)
    for s, n in enumerate(counts):
        target[s, : n + 1] = (logits[s] - logits[s].amax(-1, keepdim=True)).softmax(-1)
        draft_probs[s, :n], draft_ids[s, :n] = q[s], torch.tensor(drafts[s])
    expected = rejection_sample(
        target, draft_ids, draft_probs, torch.tensor(counts), Sampler(seed=0).generator
    )
    results = step_sampler()(torch.cat(logits), jobs)
    assert [r.token_ids for r in results] == [
        [t for t in row if t >= 0] for row in expected.tolist()
    ]
