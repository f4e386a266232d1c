"""N-gram (prompt-lookup) proposer: handcrafted cases and a naive oracle on random sequences."""

import numpy as np
import pytest

from engine.spec_decode import propose_ngram


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
