"""Statistical helpers shared by the sampler and rejection-sampler tests."""

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, threshold df + 10·sqrt(2·df)); bins with expected count < 5 are merged."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    if (exp == 0).any() and obs[exp == 0].sum() > 0:
        return math.inf, 0.0  # a token with probability 0 came out
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = len(exp) - 1
    return float(((obs - exp) ** 2 / exp).sum()), df + 10 * math.sqrt(2 * df)
