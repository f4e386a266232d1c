"""A token drawn from a row of weights: one float64 uniform per row, by inverse CDF.

A seeded row draws from its own generator, so its token never depends on what else is in the
batch; unseeded rows share one generator and draw together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def draw_rows(
    generators: Sequence[torch.Generator | None],
    draw: Callable[[int, torch.Generator | None], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """Call `draw(m, generator)` once per distinct generator and stack the results into row order.

    Rows that share a generator object draw together, in row order. A row with a generator of its
    own always calls `draw(1, g)`, so its values do not depend on what else is in the batch.
    """
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    if len(groups) == 1:
        gen, rows = next(iter(groups.values()))
        return draw(len(rows), gen)
    pieces: list[tuple[torch.Tensor, ...] | None] = [None] * len(generators)
    for gen, rows in groups.values():
        drawn = draw(len(rows), gen)
        for j, row in enumerate(rows):
            pieces[row] = tuple(t[j] for t in drawn)
    return tuple(torch.stack(column) for column in zip(*pieces, strict=True))


# Lanes per chunk of inverse_cdf's first level: a row's chunk sums are one pass over it, and
# the chosen chunk's prefix sums are short.
_CDF_CHUNK = 256
# Up to this many weights (rows x lanes) one float64 prefix sum per row costs less than the
# two levels on the CPU (one row of 49152 lanes: 172 against 295 us; 15 rows of 8192: 283
# against 364; but 4 rows of 49152: 341 against 306): a decode row, a drafter's rows.
_ONE_LEVEL_MAX_WEIGHTS = 1 << 17


def uniform_draws(
    shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """U[0, 1) draws, float64 (float32's 2^-24 steps would be coarser than small lanes and
    ratios, and can be exactly 0)."""
    return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of weights [N, V] (>= 0, need not sum to 1) and its uniform u (float64 [N] in
    [0, 1]), the id i whose interval of the cumulative weights holds u * sum(w): i with
    probability w_i / sum(w). Zero-weight lanes own empty intervals and are never returned; a
    row with no weight (or a NaN) returns 0.

    Two levels, so that no prefix sum runs over the whole vocabulary (a float32 one over 49k
    lanes would blur the smallest lanes' intervals, a float64 one is slow on many rows): chunks
    of ``_CDF_CHUNK`` lanes are chosen by their float32 sums (each chunk's share exact to ~1e-7
    of its mass), then a lane by float64 prefix sums inside the chosen chunk only, onto which
    the point is rescaled, so a lane's share of its chunk is exact. The point is kept strictly
    below each level's total, so float rounding can only move it to the last lane with weight,
    never past it. No host sync. Few weights in all (``_ONE_LEVEL_MAX_WEIGHTS``) take one
    float64 prefix sum per row instead, exact to ~V * 2^-53 of the row's mass.
    """
    if weights.numel() <= _ONE_LEVEL_MAX_WEIGHTS:
        return _one_level_inverse_cdf(weights, uniforms)
    rows, vocab = weights.shape
    pad = -vocab % _CDF_CHUNK
    padded = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    chunks = padded.reshape(rows, (vocab + pad) // _CDF_CHUNK, _CDF_CHUNK)
    sums = chunks.sum(-1, dtype=torch.float32).double()  # [N, C]
    cdf = sums.cumsum(-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, total.new_zeros(())))
    chunk = torch.searchsorted(cdf, point, right=True).clamp_(max=cdf.shape[1] - 1)  # [N, 1]
    before = torch.nn.functional.pad(cdf, (1, 0)).gather(1, chunk)
    index = torch.arange(rows, device=weights.device)
    inner = chunks[index, chunk[:, 0]].double().cumsum(-1)  # [N, _CDF_CHUNK]
    last = inner[:, -1:]
    rest = (point - before) * (last / sums.gather(1, chunk))
    rest = torch.minimum(rest, torch.nextafter(last, last.new_zeros(())))
    lane = torch.searchsorted(inner, rest, right=True).clamp_(max=_CDF_CHUNK - 1)
    ids = (chunk * _CDF_CHUNK + lane)[:, 0].clamp_(max=vocab - 1)
    return torch.where(total[:, 0] > 0, ids, 0)


def _one_level_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf`` over one float64 prefix sum per row, the point kept below the total."""
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, total.new_zeros(())))
    ids = torch.searchsorted(cdf, point, right=True)[:, 0]
    return torch.where(total[:, 0] > 0, ids, 0)


def sample_from_probs(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None,
) -> torch.Tensor:
    """Sample one id per row of probs [N, V] (weights, need not sum to 1) by ``inverse_cdf``.

    Each seeded row draws exactly one float64 uniform from its own generator; rows whose
    generator is None draw together from `shared_generator`.
    """
    if len(generators) != probs.shape[0]:
        raise ValueError(f"generators has {len(generators)} rows, probs has {probs.shape[0]}")

    def draw(m: int, gen: torch.Generator | None) -> tuple[torch.Tensor]:
        return (uniform_draws((m,), probs.device, gen),)

    rows = [shared_generator if g is None else g for g in generators]
    (uniforms,) = draw_rows(rows, draw)
    return inverse_cdf(probs, uniforms)
