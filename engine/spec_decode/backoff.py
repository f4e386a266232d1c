"""Per-sequence draft backoff: stop paying for verification where drafts keep failing.

A draft round costs a verification pass over 1 + k rows; when no draft is accepted it yields one
token, like a plain decode step, at a higher price. On text that does not repeat its context
(open chat), n-gram drafts are mostly wrong and forced speculation is slower than none
(benchmarks/RESULTS.md). After a round with nothing accepted, a sequence skips drafting for 1
step, then 2, 4, ... up to ``max_skip`` while its rounds keep failing; one accepted draft resets
it. Drafting less keeps the output distribution (verification is lossless either way); the exact
tokens can differ only where float summation order flips a near-tie, as with any change of batch
composition.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _State:
    skip: int = 0  # steps left without drafts
    backoff: int = 0  # length of the last skip


class DraftBackoff:
    def __init__(self, max_skip: int) -> None:
        if max_skip < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        self.max_skip = max_skip
        self._states: dict[int, _State] = {}

    def should_draft(self, seq_id: int) -> bool:
        """Whether to draft for this sequence this step (counts down a skip when not)."""
        state = self._states.get(seq_id)
        if state is None or state.skip == 0:
            return True
        state.skip -= 1
        return False

    def record(self, seq_id: int, num_accepted: int) -> None:
        """The outcome of a verification round: how many of its drafts were accepted."""
        state = self._states.setdefault(seq_id, _State())
        if num_accepted > 0:
            state.backoff = 0
        else:
            state.backoff = min(max(1, 2 * state.backoff), self.max_skip)
            state.skip = state.backoff

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
