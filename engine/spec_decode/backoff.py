"""Per-sequence draft backoff: stop paying for verification where drafts keep failing.

A draft round costs a verification pass over 1 + k rows; when no draft is accepted it yields one
token, like a plain decode step, at a higher price. On text that does not repeat its context
(open chat), n-gram drafts are mostly wrong and forced speculation is slower than none
(benchmarks/RESULTS.md). After a round with nothing accepted, a sequence skips drafting for its
next 1 output token, then 2, 4, ... up to ``max_skip`` while its rounds keep failing; one
accepted draft resets it. Drafting less keeps the output distribution (verification is lossless
either way); the exact tokens can differ only where float summation order flips a near-tie, as
with any change of batch composition.

Asking whether to draft changes nothing (a step that fails and is retried asks again); only
``record``, called when a round commits, moves the state.
"""

from __future__ import annotations

from pagedspec.engine.spec_decode.draft_state import DraftState


class DraftBackoff:
    """The rule; its state lives on each sequence's ``DraftState``."""

    def __init__(self, max_skip: int) -> None:
        if max_skip < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        self.max_skip = max_skip

    @staticmethod
    def should_draft(state: DraftState, num_output_tokens: int) -> bool:
        return num_output_tokens >= state.resume_at

    def record(self, state: DraftState, num_accepted: int, num_output_tokens: int) -> None:
        """A verification round committed: ``num_accepted`` drafts were accepted and the
        sequence now has ``num_output_tokens`` outputs."""
        if num_accepted > 0:
            state.backoff = 0
        else:
            state.backoff = min(max(1, 2 * state.backoff), self.max_skip)
        state.resume_at = num_output_tokens + state.backoff
