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
