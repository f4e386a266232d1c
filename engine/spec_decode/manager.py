"""The speculation manager: every decision about drafts, in one place.

Per step it decides each sequence's k (load, backoff, max_tokens and max_model_len), runs the
proposer, verifies drafts against the target's samples, and, when the engine commits, records
acceptance, backoff and the proposer's KV state. The engine never sees a proposer's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode.backoff import DraftBackoff
from engine.spec_decode.proposers import Proposal, Proposer, TargetStep
from engine.spec_decode.rejection import verify_deterministic_drafts
from engine.spec_decode.tree import tree_slots
from scheduler import ScheduledSequence, Sequence


class SpeculationManager:
    def __init__(
        self, config: SpeculativeConfig | None, proposer: Proposer | None, max_model_len: int
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.backoff = DraftBackoff(config.draft_skip if config else 0)
        self.leaves = config.leaves if config else 0
        self.num_lookahead_slots = config.num_speculative_tokens if config else 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.num_leaf_tokens = 0
        self.accepted_by_position = [0] * self.num_lookahead_slots

    def lookahead(
        self, num_busy: int, params_of: Callable[[Sequence], SamplingParams]
    ) -> Callable[[Sequence], int]:
        """This step's k per sequence (a function for ``Scheduler.schedule``).

        Off for the whole step when ``num_busy`` (running + waiting) sequences reach
        ``disable_batch_size``: a step that full is compute-bound and verification is no longer
        free. Otherwise k, capped so that drafts never pass ``max_tokens`` or ``max_model_len``,
        and 0 for a sequence in backoff or with no output yet (its prompt is being computed).
        With draft leaves, k's chain and its leaves (``tree_slots``), unless ``num_busy``
        reaches ``disable_tree_batch_size``: then the chain alone.
        """
        config = self.config
        if config is None or num_busy >= config.off_batch_size:
            return lambda seq: 0
        leaves = self.leaves if num_busy < config.disable_tree_batch_size else 0

        def k(seq: Sequence) -> int:
            outputs = seq.num_output_tokens
            if not outputs or not self.backoff.should_draft(seq.seq_id, outputs):
                return 0
            return tree_slots(self._max_depth(seq, params_of(seq)), leaves)

        return k

    def _max_depth(self, seq: Sequence, params: SamplingParams) -> int:
        """k, capped so that drafts never pass ``max_tokens`` or ``max_model_len``."""
        left = (params.max_tokens or self.max_model_len) - seq.num_output_tokens
        return max(0, min(self.num_lookahead_slots, left - 1, self.max_model_len - len(seq) - 1))

    def propose(
        self,
        scheduled: list[ScheduledSequence],
        params_of: Callable[[Sequence], SamplingParams],
    ) -> Proposal:
        """Drafts for the sequences that reserved lookahead slots (a draft model also runs every
        span, see ``DraftModelProposer``). Slots the scheduler cut short (token budget) go to
        the chain first, then to leaves."""
        slots = [s.num_lookahead_slots if s.samples else 0 for s in scheduled]
        ks = [min(n, self._max_depth(s.seq, params_of(s.seq))) if n else 0
              for s, n in zip(scheduled, slots, strict=True)]  # fmt: skip
        if self.proposer is None or not (any(ks) or self.proposer.runs_every_span):
            return Proposal([[] for _ in scheduled], [None] * len(scheduled), {})
        params = [params_of(s.seq) if k else None for s, k in zip(scheduled, ks, strict=True)]
        if not self.config.sample_drafts:  # draft the argmax; verification sees no q
            params = [p if p is None else dataclasses.replace(p, temperature=0.0) for p in params]
        if not self.leaves:
            return self.proposer.propose(scheduled, ks, params)
        leaf_slots = [n - k for n, k in zip(slots, ks, strict=True)]
        return self.proposer.propose(scheduled, ks, params, leaf_slots)

    @staticmethod
    def verify(samples: Seq[int], drafts: Seq[Seq[int]], starts: Seq[int]) -> list[list[int]]:
        """Each sequence's emitted tokens: its accepted drafts, then one recovered or bonus
        token (``verify_deterministic_drafts``: every proposer here is deterministic)."""
        return verify_deterministic_drafts(samples, drafts, starts)

    def commit(
        self,
        seq: Sequence,
        new_token_ids: list[int],
        num_drafts: int,
        num_emitted: int,
        proposal: Proposal,
        scheduled_as: Sequence,
        target: TargetStep,
        at_leaf: bool = False,
    ) -> int | None:
        """Record a round of ``seq`` about to commit ``new_token_ids`` (``scheduled_as`` is the
        sequence the step ran: itself, or the parent whose prompt a new fork shares; ``at_leaf``:
        its last accepted token was a draft-tree leaf); returns how many of ``seq``'s tokens
        the proposer's KV covers (None: it keeps no KV)."""
        self.num_leaf_tokens += at_leaf
        if num_drafts:
            accepted = num_emitted - 1
            self.backoff.record(seq.seq_id, accepted, seq.num_output_tokens + len(new_token_ids))
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += accepted
            self.num_verifications += 1
            for j in range(accepted):
                self.accepted_by_position[j] += 1
        if self.proposer is None:
            return None
        return self.proposer.commit(
            seq.seq_id, proposal.written.get(scheduled_as.seq_id), new_token_ids, target
        )

    @property
    def needs_target_hidden(self) -> bool:
        return self.proposer is not None and self.proposer.needs_target_hidden

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return () if self.proposer is None else self.proposer.hidden_layers

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The proposer's features of a step's target hidden states (needs_target_hidden)."""
        assert self.proposer is not None
        return self.proposer.target_features(hidden)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if self.proposer is not None:
            self.proposer.copy_blocks(pairs)

    def fork(self, parent_id: int, child_id: int) -> None:
        if self.proposer is not None:
            self.proposer.fork(parent_id, child_id)

    def release(self, seq_id: int) -> None:
        if self.proposer is not None:
            self.proposer.release(seq_id)
        self.backoff.release(seq_id)

    def stats(self) -> dict:
        return dict(
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_verifications=self.num_verifications,
            num_leaf_tokens=self.num_leaf_tokens,
            accepted_by_position=tuple(self.accepted_by_position),
        )
