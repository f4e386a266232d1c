"""N-gram (prompt-lookup) proposer: handcrafted cases and a naive oracle on random sequences."""

import numpy as np
import pytest

from pagedspec.engine.spec_decode import propose_ngram
from pagedspec.engine.spec_decode.ngram import NgramIndex


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    ("tokens", "kwargs", "expected"),
    [
        # an older 2-gram match beats a more recent 1-gram match
        ([5, 6, 7, 9, 6, 8, 5, 6], {"k": 3}, [7, 9, 6]),
        ([5, 6, 7, 9, 6, 8, 5, 6], {"k": 3, "max_n": 1}, [8, 5, 6]),
        # the most recent of two equal-length matches
        ([1, 2, 3, 1, 2, 4, 1, 2], {"k": 3}, [4, 1, 2]),
        # truncated at the end of the sequence
        ([1, 2, 3, 1, 2], {"k": 5}, [3, 1, 2]),
        # an earlier match may overlap the suffix
        ([7, 7, 7, 7], {"k": 4}, [7]),
        # no match at all / none long enough for min_n
        ([1, 2, 3], {"k": 2}, []),
        ([1, 2, 3, 2], {"k": 2, "min_n": 2}, []),
        ([1, 2, 3, 2], {"k": 2}, [3, 2]),
        # the suffix itself is not an earlier occurrence; too short to match
        ([4], {"k": 2}, []),
        ([], {"k": 2}, []),
        ([3, 4, 3], {"k": 0}, []),
    ],
)
def test_handcrafted(tokens, kwargs, expected):
    assert propose_ngram(tokens, **kwargs) == expected
    assert propose_ngram(np.array(tokens, dtype=np.int64), **kwargs) == expected


def test_matches_naive_oracle_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        tokens = rng.integers(0, rng.integers(2, 7), size=rng.integers(0, 60)).tolist()
        k = int(rng.integers(0, 8))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        assert propose_ngram(tokens, k, min_n, max_n) == naive_propose(tokens, k, min_n, max_n)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"k": -1}, "k"), ({"min_n": 0}, "min_n"), ({"min_n": 3, "max_n": 2}, "max_n")],
)
def test_bad_arguments_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        propose_ngram([1, 2, 1], **({"k": 2} | kwargs))


def test_an_index_kept_as_the_sequence_grows_matches_the_oracle_at_every_length():
    """What the engine keeps per sequence: one NgramIndex asked at each length (sometimes
    skipping lengths, as backoff does), and a fork's copy growing apart from its parent."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        max_n, min_n = int(rng.integers(1, 5)), 1
        tokens = rng.integers(0, rng.integers(2, 6), size=int(rng.integers(1, 50))).tolist()
        index = NgramIndex(max_n)
        for length in range(1, len(tokens) + 1):
            if rng.random() < 0.3:
                continue  # not asked at this length
            k = int(rng.integers(0, 5))
            expected = naive_propose(tokens[:length], k, min_n, max_n)
            assert index.propose(tokens[:length], k, min_n) == expected
        fork = index.copy()
        for copy, tail in ((fork, [0, 1, 2, 0, 1, 2, 0]), (index, [2, 1, 0, 2, 1, 0, 2])):
            for j in range(1, len(tail) + 1):  # the fork first, then its parent, apart
                grown = tokens + tail[:j]
                assert copy.propose(grown, 3, min_n) == naive_propose(grown, 3, min_n, max_n)
