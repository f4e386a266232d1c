"""Statistical helpers shared by the sampler and rejection-sampler tests."""

import math

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, the chi-square quantile at 1 - 1e-4): ``chi_square_test`` without df."""
    stat, threshold, _ = chi_square_test(counts, probs)
    return stat, threshold


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    if x <= 0:
        return 1.0
    a, half = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, half))


def chi2_isf(p: float, df: int) -> float:
    """The x with P(X > x) = p for X ~ chi-square(df) (exact, by bisection on chi2_sf)."""
    if df < 1 or not 0 < p < 1:
        raise ValueError(f"need df >= 1 and 0 < p < 1, got df={df}, p={p}")
    lo, hi = 0.0, df + 10.0
    while chi2_sf(hi, df) > p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > p else (lo, mid)
        if hi - lo < 1e-9 * hi:
            break
    return hi


def chi_square_test(
    counts: torch.Tensor, probs: torch.Tensor, p_value: float = 1e-4
) -> tuple[float, float, int]:
    """Pearson's chi-square of observed counts against exact cell probabilities.

    Cells with expected count < 5 are merged into one (if that pooled cell is itself below 5 it
    joins the smallest remaining cell). Returns (statistic, the chi-square(df) quantile at
    1 - p_value, df); the statistic is inf when a cell of probability 0 was observed.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if (probs < 0).any() or abs(float(probs.sum()) - 1) > 1e-6:
        raise ValueError(f"probs must be a distribution (sum {float(probs.sum())})")
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0, 0
    expected = probs * counts.sum()
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp < 5 and len(exp) > 0:
            i = int(exp.argmin())
            obs, exp = obs.clone(), exp.clone()
            obs[i] += pooled_obs
            exp[i] += pooled_exp
        else:
            obs = torch.cat([obs, pooled_obs[None]])
            exp = torch.cat([exp, pooled_exp[None]])
    df = len(exp) - 1
    if df < 1:
        raise ValueError("fewer than 2 cells with expected count >= 5: draw more samples")
    return float(((obs - exp) ** 2 / exp).sum()), chi2_isf(p_value, df), df
