"""What speculation keeps about one sequence, on its engine record (``SampleState.draft``).

A fork copies it (the child shares the parent's history, so its drafter state too); a
preempted sequence gets a fresh one (its blocks, and the drafter's KV in them, are gone); a
finished one drops it with its record. Only a committing step moves it (``Speculation.commit``):
a step that fails before then leaves it as it was.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedspec.engine.spec_decode.ngram import NgramIndex


@dataclasses.dataclass
class DraftState:
    # backoff (pagedspec.engine.spec_decode.backoff): drafting resumes at this many output tokens,
    # after a skip of this length
    resume_at: int = 0
    backoff: int = 0
    # A drafter with KV of its own (a draft model, an EAGLE head): it covers token positions
    # < valid; None: nothing fed yet (a new or re-admitted sequence).
    valid: int | None = None
    # EAGLE: the target's features at positions first, first + 1, ... (what the head feeds next)
    first: int = 0
    features: torch.Tensor | None = None
    # n-gram drafting: the index of the sequence's committed tokens (a cache, built on demand)
    ngram: NgramIndex | None = None

    def fork(self) -> DraftState:
        """The child's copy (``features`` is shared: it is replaced, never written in place)."""
        ngram = None if self.ngram is None else self.ngram.copy()
        return dataclasses.replace(self, ngram=ngram)
