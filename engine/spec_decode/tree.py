"""Draft trees: a chain of drafts with leaves beside it, verified in one forward.

A tree here is the chain a drafter makes (d_1 .. d_n, each following the one before) plus
leaves: more of the drafter's top-ranked tokens at some depth t, siblings of d_t that nothing
follows, placed where their paths are likeliest (``proposers.chain_drafts``). The target
verifies every node in one span (``Span.parents``): a node's row is the target's distribution
after its root-to-node path.

Verification is the chain's, unchanged (exact match or ``rejection_sample``), then one step
more: where the chain stops at depth t with the token y (a recovered or mismatch token), and a
leaf at depth t holds y, the leaf's row is the target's distribution after the emitted tokens,
so one more token is sampled from it. That token is drawn from the target's own p exactly as the
next step would draw it (under a constraint, masked by the grammar after the emitted tokens), and
y is what the chain's verification emits anyway, so the output law is the chain's (the target's)
whichever tokens the leaves hold.

The leaf's K/V was written at its own slot in the span (start + its index), not at its
position's (start + t): committing it copies that one token's K/V per layer into place
(``ModelRunner.move_kv``); the chain's rejected K/V is left to be overwritten, as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.grammar import advanced
from engine.sample_jobs import SampleJob, SampleResult
from engine.step_sampler import StepSampler

if TYPE_CHECKING:
    from engine.spec_decode.proposers import Proposal


@dataclass(frozen=True)
class DraftTree:
    """drafts[:chain] are the chain; drafts[chain + j] is a leaf at depth leaf_depths[j]
    (depth 1: a sibling of the first draft)."""

    chain: int
    leaf_depths: tuple[int, ...]

    @property
    def parents(self) -> tuple[int, ...]:
        """Span.parents of [last token, *drafts]: chain node t (span index t) follows t - 1; a
        leaf at depth t follows chain node t - 1 (span index 0 being the last token)."""
        return (-1, *range(self.chain), *(depth - 1 for depth in self.leaf_depths))

    def leaf_hit(self, drafts: Sequence[int], emitted: Sequence[int]) -> int | None:
        """The span index of the leaf holding the last token that verifying the chain emitted
        (at depth len(emitted)), if any."""
        depth, token = len(emitted), emitted[-1]
        for j, leaf_depth in enumerate(self.leaf_depths):
            if leaf_depth == depth and drafts[self.chain + j] == token:
                return 1 + self.chain + j
        return None


def tree_slots(depth: int, leaves: int) -> int:
    """Draft slots of a chain of ``depth`` drafts with up to ``leaves`` leaves beside it."""
    return depth + leaves if depth else 0


def sample_at_leaves(
    sampler: StepSampler,
    proposal: Proposal,
    logits: torch.Tensor,
    jobs: list[SampleJob],
    owners: list[int],
    results: list[list[SampleResult]],
    first_rows: dict[int, int],
) -> dict[int, int]:
    """Where a draft tree's chain emitted the token a leaf holds, one more token from the
    leaf's row (the target's p after the emitted tokens), appended to that sequence's result;
    returns the leaves used: span index by scheduled index."""
    follow, used = [], {}
    for job, i in zip(jobs, owners, strict=True):
        tree = proposal.trees.get(i)
        if tree is None:
            continue
        emitted = results[i][0].token_ids  # a sequence with drafts feeds one sample
        leaf = tree.leaf_hit(proposal.drafts[i], emitted)
        if leaf is not None:
            used[i] = leaf
            follow.append(job._replace(
                num_outputs=job.num_outputs + len(emitted),
                token_ids=[*job.token_ids, *emitted], row=first_rows[i] + leaf,
                drafts=(), draft_probs=None, grammar_bits=None,
                grammar=None if job.grammar is None
                else advanced(job.grammar, emitted, sampler.eos_token_ids),
            ))  # fmt: skip
    for i, more in zip(used, sampler(logits, follow), strict=True):
        first = results[i][0]
        logprobs = None if first.logprobs is None else first.logprobs + (more.logprobs or [])
        results[i][0] = SampleResult(first.token_ids + more.token_ids, logprobs)
    return used
