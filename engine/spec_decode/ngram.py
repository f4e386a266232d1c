"""Prompt-lookup (n-gram) drafting: propose what followed an earlier copy of the suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
    length = tokens.shape[0]
    if k == 0 or length <= min_n:  # an earlier match of n tokens needs n + 1 tokens in all
        return []
    # ends: end positions j <= length - 2 of earlier matches of the last n tokens, ascending
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    best = -1
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = int(ends[-1])
    if best < 0:
        return []
    return tokens[best + 1 : best + 1 + k].tolist()
