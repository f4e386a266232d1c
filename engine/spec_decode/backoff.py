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

from dataclasses import dataclass


@dataclass
class _State:
    resume_at: int = 0  # drafting resumes once the sequence has this many output tokens
    backoff: int = 0  # length of the last skip


class DraftBackoff:
    def __init__(self, max_skip: int) -> None:
        if max_skip < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        self.max_skip = max_skip
        self._states: dict[int, _State] = {}

    def should_draft(self, seq_id: int, num_output_tokens: int) -> bool:
        state = self._states.get(seq_id)
        return state is None or num_output_tokens >= state.resume_at

    def record(self, seq_id: int, num_accepted: int, num_output_tokens: int) -> None:
        """A verification round committed: ``num_accepted`` drafts were accepted and the
        sequence now has ``num_output_tokens`` outputs."""
        state = self._states.setdefault(seq_id, _State())
        if num_accepted > 0:
            state.backoff = 0
        else:
            state.backoff = min(max(1, 2 * state.backoff), self.max_skip)
        state.resume_at = num_output_tokens + state.backoff

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
