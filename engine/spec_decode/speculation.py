"""Speculation on: drafts from a proposer (n-gram, draft model or EAGLE head), verified by
the target in the same forward (``engine.spec_decode.round`` describes the round)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from engine.config import SpeculativeConfig
from engine.model_runner import ModelRunner
from engine.request import SampleState
from engine.sample_jobs import SampleJob, SampleResult
from engine.spans import Span
from engine.spec_decode.backoff import DraftBackoff
from engine.spec_decode.draft_state import DraftState
from engine.spec_decode.proposers import Proposal, Proposer, TargetStep
from engine.spec_decode.round import (
    NoSpeculation,
    Round,
    by_owner,
    greedy_round,
    keep_prompt_logprobs,
    logit_rows,
)
from engine.spec_decode.tree import sample_at_leaves, tree_slots
from engine.step_sampler import StepSampler
from scheduler import ScheduledSequence, SchedulerOutput, Sequence


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

    def prepare(self, sched: SchedulerOutput) -> Round:
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
        options = {}
        if self.proposer.needs_target_hidden:
            options = {"return_hidden": True, "hidden_layers": self.proposer.hidden_layers}
        return Round(scheduled, spans, proposal, options)

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
    def verify(self, round: Round, output: Any) -> list[list[SampleResult]]:
        logits = output
        if self.proposer.needs_target_hidden:
            logits, hidden = output
            features = self.proposer.target_features(hidden)
            round.features = list(features.split([len(s.token_ids) for s in round.spans]))
        proposal = round.proposal
        if not any(proposal.drafts):  # nothing to verify this step: plain sampling
            return super().verify(round, logits)
        if not proposal.trees and all(q is None for q in proposal.draft_probs):
            greedy = greedy_round(round, logits)
            if greedy is not None:
                return greedy
        jobs, owners, first_rows = [], [], {}
        row = 0
        for i, (s, span) in enumerate(zip(round.scheduled, round.spans, strict=True)):
            if not span.num_logits:
                continue
            record: SampleState = s.seq.owner
            params, outputs = record.request.params, s.seq.num_output_tokens
            drafts, q = proposal.drafts[i], proposal.draft_probs[i]
            if (tree := proposal.trees.get(i)) is not None:  # the chain is verified as one
                drafts = drafts[: tree.chain]
            first_rows[i] = first = row + keep_prompt_logprobs(round, i, logits, row)
            row += span.num_logits
            if not s.samples:  # a prompt chunk that only reports prompt logprobs
                continue
            for index in (record.index,) if outputs else range(params.n):
                jobs.append(SampleJob(params, index, outputs, s.seq.token_ids, first, drafts, q,
                                      record.grammar, proposal.grammar_bits.get(i)))  # fmt: skip
                owners.append(i)
        results = by_owner(len(round.scheduled), owners, self.sampler(logits, jobs))
        if proposal.trees:
            round.leaf_hits = sample_at_leaves(
                self.sampler, proposal, logits, jobs, owners, results, first_rows
            )
        return results

    def commit(
        self, round: Round, i: int, record: SampleState, emitted: int, kept: list[int]
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
        features = round.features[i] if round.features is not None else None
        leaf = round.leaf_hits.get(i)
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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.proposer.copy_blocks(pairs)


def _draft_params(record: SampleState, config: SpeculativeConfig):
    """What a drafter drafts a sequence with: its request's params, at temperature 0 (the
    argmax) where ``sample_drafts`` is off or the request is seeded. A seeded request's tokens
    are then its per-position seeded samples, exactly those of a run without speculation,
    whatever was drafted (the prefix cache, the batch or backoff change the drafts)."""
    params = record.request.params
    if params.temperature and (params.seed is not None or not config.sample_drafts):
        params = dataclasses.replace(params, temperature=0.0)
    return params
