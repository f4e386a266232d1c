"""Prompt-lookup (n-gram) drafting: propose what followed an earlier copy of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramIndex:
    """Where each n-gram (n <= max_n) of a growing token sequence last ended, kept up to date
    as the sequence grows: each token is indexed once (max_n entries), so a proposal costs
    O(max_n + k) instead of a scan of the whole sequence.

    Invariant: ``ends[tuple(tokens[j - n + 1 : j + 1])]`` is the largest such j below
    ``num_indexed`` for every n-gram there; the tokens indexed never change (a sequence's
    committed tokens only grow).
    """

    __slots__ = ("max_n", "ends", "num_indexed")

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0

    def copy(self) -> NgramIndex:
        """An index of its own for a fork (the two sequences grow apart)."""
        new = NgramIndex(self.max_n)
        new.ends, new.num_indexed = dict(self.ends), self.num_indexed
        return new

    def propose(self, tokens: Sequence[int], k: int, min_n: int) -> list[int]:
        """``propose_ngram(tokens, k, min_n, self.max_n)``, for the sequence this index follows."""
        length = len(tokens)
        if k == 0 or length <= min_n:  # an earlier match of n tokens needs n + 1 tokens in all
            return []
        self._index(tokens, length - 1)  # every n-gram that ends before the last token
        suffix = tuple(tokens[length - min(self.max_n, length - 1) :])
        for n in range(len(suffix), min_n - 1, -1):  # the longest match wins
            end = self.ends.get(suffix[-n:])
            if end is not None:
                return list(tokens[end + 1 : end + 1 + k])
        return []

    def _index(self, tokens: Sequence[int], stop: int) -> None:
        ends, max_n = self.ends, self.max_n
        for j in range(self.num_indexed, stop):
            gram = tuple(tokens[max(0, j + 1 - max_n) : j + 1])  # the longest ending at j
            for n in range(1, len(gram) + 1):
                ends[gram[-n:]] = j
        self.num_indexed = max(self.num_indexed, stop)


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4
) -> list[int]:
    """Draft up to k tokens by matching the last n tokens against the earlier ones.

    n runs from max_n down to min_n and the longest n with a match wins; among its matches the most
    recent earlier occurrence wins (it may overlap the suffix, but not be the suffix itself). The
    proposal is the up-to-k tokens that followed it, fewer if the sequence ends; [] if none match.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"min_n and max_n must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    return NgramIndex(max_n).propose(tokens.tolist(), k, min_n)
