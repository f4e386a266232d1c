"""Speculation on: drafts from a proposer (n-gram, draft model or EAGLE head), verified by
the target in the same forward (``pagedspec.engine.sample.round`` describes the round)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pagedspec.engine.config import SpeculativeConfig
from pagedspec.engine.request import SampleState
from pagedspec.engine.sample.grammar import advanced
from pagedspec.engine.sample.round import (
    NoSpeculation,
    Round,
    StepJobs,
    Verified,
    by_owner,
    greedy_round,
    logit_rows,
    sample_jobs,
)
from pagedspec.engine.sample.sample_jobs import SampleResult
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.engine.spec_decode.backoff import DraftBackoff
from pagedspec.engine.spec_decode.draft_state import DraftState
from pagedspec.engine.spec_decode.proposers import Proposal, Proposer, TargetStep
from pagedspec.engine.spec_decode.tree import tree_slots
from pagedspec.engine.worker.model_runner import ForwardOutput, ModelRunner
from pagedspec.engine.worker.spans import Span
from pagedspec.scheduler import ScheduledSequence, SchedulerOutput, Sequence


@dataclasses.dataclass(frozen=True)
class SpecRound(Round):
    """A round with the proposer's drafts (none for a sequence that does not draft)."""

    proposal: Proposal = Proposal([], [], {})


class Speculation(NoSpeculation):
    """Drafts from a proposer, verified by the target in the same forward; acceptance,
    backoff and the proposer's per-sequence state (``DraftState``) move in ``commit``."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        sampler: StepSampler,
        runner: ModelRunner,
        max_model_len: int,
    ) -> None:
        super().__init__(sampler, config.num_speculative_tokens)
        self.config = config
        self.proposer = proposer
        self.runner = runner  # the target's: a kept leaf's K/V moves in its cache
        self.max_model_len = max_model_len
        self.backoff = DraftBackoff(config.max_draft_skip)
        # A draft model or head runs every span (its KV follows the target's) or reads the
        # target's features; a proposer with neither (n-gram) samples nothing and keeps no KV.
        self.has_draft_model = proposer.runs_every_span or proposer.needs_target_hidden

    # --- before the forward ---------------------------------------------------------------
    def lookahead(self, num_busy: int) -> int | Callable[[Sequence], int]:
        """This step's k per sequence: off for the whole step when ``num_busy`` (running +
        waiting) sequences reach ``disable_batch_size`` (the step is compute-bound, and
        verification no longer free); else k capped by max_tokens and max_model_len, 0 for a
        sequence in backoff or with no output yet; with draft leaves the chain's and its
        leaves' slots (``tree_slots``), the chain alone from ``disable_tree_batch_size``."""
        config = self.config
        if num_busy >= config.disable_batch_size:
            return 0
        leaves = config.draft_leaves if num_busy < config.disable_tree_batch_size else 0
        should_draft = self.backoff.should_draft

        def k(seq: Sequence) -> int:
            outputs = seq.num_output_tokens
            if not outputs or not should_draft(seq.owner.draft, outputs):
                return 0
            return tree_slots(self._max_depth(seq), leaves)

        return k

    def _max_depth(self, seq: Sequence) -> int:
        """k, capped so that drafts never pass ``max_tokens`` or ``max_model_len``."""
        params = seq.owner.request.params
        left = (params.max_tokens or self.max_model_len) - seq.num_output_tokens
        return max(0, min(self.k, left - 1, self.max_model_len - len(seq) - 1))

    def new_draft(self) -> DraftState:
        return DraftState()

    def prepare(self, sched: SchedulerOutput) -> SpecRound:
        self.proposer.copy_blocks(sched.blocks_to_copy)
        scheduled = sched.scheduled
        proposal = self._propose(scheduled)
        spans = [
            Span(
                s.seq.token_ids[s.start : s.end] + drafts,
                s.start,
                logit_rows(s, len(drafts)),
                s.block_table,
                tree.parents if (tree := proposal.trees.get(i)) else None,
            )
            for i, (s, drafts) in enumerate(zip(scheduled, proposal.drafts, strict=True))
        ]
        hidden = self.proposer.needs_target_hidden
        layers = self.proposer.hidden_layers if hidden else ()
        return SpecRound(scheduled, spans, hidden, layers, proposal)

    def _propose(self, scheduled: list[ScheduledSequence]) -> Proposal:
        """Drafts for the sequences that reserved lookahead slots (a draft model also runs every
        span). Slots the scheduler cut short (token budget) go to the chain first, then to
        leaves."""
        slots = [s.num_lookahead_slots if s.samples else 0 for s in scheduled]
        ks = slots  # without leaves every slot is the chain's (lookahead capped it already)
        if self.config.draft_leaves:
            ks = [min(n, self._max_depth(s.seq)) if n else 0
                  for s, n in zip(scheduled, slots, strict=True)]  # fmt: skip
        if not (any(ks) or self.proposer.runs_every_span):
            return Proposal([[] for _ in scheduled], [None] * len(scheduled), {})
        params = [
            _draft_params(s.seq.owner, self.config) if k and self.has_draft_model else None
            for s, k in zip(scheduled, ks, strict=True)
        ]
        if not self.config.draft_leaves:
            return self.proposer.propose(scheduled, ks, params)
        leaf_slots = [n - k for n, k in zip(slots, ks, strict=True)]
        return self.proposer.propose(scheduled, ks, params, leaf_slots)

    # --- after the forward ----------------------------------------------------------------
    def verify(self, round: SpecRound, output: ForwardOutput) -> Verified:
        logits, features = output.logits, None
        if self.proposer.needs_target_hidden:
            hidden = self.proposer.target_features(output.hidden)
            features = list(hidden.split([len(s.token_ids) for s in round.spans]))
        proposal = round.proposal
        if not any(proposal.drafts):  # nothing to verify this step: plain sampling
            return dataclasses.replace(super().verify(round, output), features=features)
        if not proposal.trees and all(q is None for q in proposal.draft_probs):
            greedy = greedy_round(round, logits, proposal.drafts)
            if greedy is not None:
                return Verified(greedy, features=features)
        drafts = [  # a tree's chain is verified as one, its leaves after (_sample_at_leaves)
            d if (tree := proposal.trees.get(i)) is None else d[: tree.chain]
            for i, d in enumerate(proposal.drafts)
        ]
        step = sample_jobs(round, logits, drafts, proposal.draft_probs, proposal.grammar_bits)
        results = by_owner(len(round.scheduled), step.owners, self.sampler(logits, step.jobs))
        leaf_hits = {}
        if proposal.trees:
            leaf_hits = _sample_at_leaves(self.sampler, proposal, logits, step, results)
        return Verified(results, step.prompt_logprobs, features, leaf_hits)

    def commit(
        self,
        round: SpecRound,
        verified: Verified,
        i: int,
        record: SampleState,
        emitted: int,
        kept: list[int],
    ) -> int | None:
        s = round.scheduled[i]
        num_drafts = len(round.proposal.drafts[i])
        if num_drafts:
            accepted = emitted - 1
            outputs = len(record.seq.token_ids) - record.seq.num_prompt_tokens + len(kept)
            self.backoff.record(record.draft, accepted, outputs)
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += accepted
            self.num_verifications += 1
            self.verifications_by_accepted[accepted] += 1
        if not self.has_draft_model:  # nothing of the step to record
            return None
        num_computed = s.start + s.num_new_tokens + max(len(kept) - 1, 0)
        features = verified.features[i] if verified.features is not None else None
        leaf = verified.leaf_hits.get(i)
        if leaf is not None and len(kept) == emitted:  # the leaf's token is the last but one
            depth = len(kept) - 1
            self.runner.move_kv(s.block_table, [(s.start + leaf, s.start + depth)])
            if features is not None:  # its rows by position, as the proposer reads them
                features = torch.cat([features[:depth], features[leaf : leaf + 1]])
            self.num_leaf_tokens += 1
        written = round.proposal.written.get(s.seq.seq_id)
        target = TargetStep(s.start, features, num_computed)
        return self.proposer.commit(record.draft, written, kept, target)

    def reset(self, record: SampleState) -> None:
        record.draft = DraftState()


def _sample_at_leaves(
    sampler: StepSampler,
    proposal: Proposal,
    logits: torch.Tensor,
    step: StepJobs,
    results: list[list[SampleResult]],
) -> dict[int, int]:
    """Where a draft tree's chain emitted the token a leaf holds, one more token from the
    leaf's row (the target's p after the emitted tokens: ``pagedspec.engine.spec_decode.tree``
    says why the law stays the target's), appended to that sequence's result; returns the
    leaves used: span index by scheduled index."""
    follow, used = [], {}
    for job, i in zip(step.jobs, step.owners, strict=True):
        tree = proposal.trees.get(i)
        if tree is None:
            continue
        emitted = results[i][0].token_ids  # a sequence with drafts feeds one sample
        leaf = tree.leaf_hit(proposal.drafts[i], emitted)
        if leaf is not None:
            used[i] = leaf
            follow.append(job._replace(
                num_outputs=job.num_outputs + len(emitted),
                token_ids=[*job.token_ids, *emitted], row=step.first_rows[i] + leaf,
                drafts=(), draft_probs=None, grammar_bits=None,
                grammar=None if job.grammar is None
                else advanced(job.grammar, emitted, sampler.eos_token_ids),
            ))  # fmt: skip
    for i, more in zip(used, sampler(logits, follow), strict=True):
        first = results[i][0]
        logprobs = None if first.logprobs is None else first.logprobs + (more.logprobs or [])
        results[i][0] = SampleResult(first.token_ids + more.token_ids, logprobs)
    return used


def _draft_params(record: SampleState, config: SpeculativeConfig):
    """What a drafter drafts a sequence with: its request's params, at temperature 0 (the
    argmax) where ``sample_drafts`` is off or the request is seeded. A seeded request's tokens
    are then its per-position seeded samples, exactly those of a run without speculation,
    whatever was drafted (the prefix cache, the batch or backoff change the drafts)."""
    params = record.request.params
    if params.temperature and (params.seed is not None or not config.sample_drafts):
        params = dataclasses.replace(params, temperature=0.0)
    return params
