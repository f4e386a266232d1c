"""Token sampling: temperature, top-k, top-p, min-p, per-request seeds; logprobs.

Everything is vectorised over the batch; Python loops run over generator groups only (one group per
seeded row plus one for all unseeded rows), never over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprob


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters for N rows (built by the ModelRunner, usually via `from_params`).

    `all_greedy` and `needs_sort` are host-side hints so sampling never reads the parameter tensors
    back from the device; their defaults are the safe choice for a batch built by hand.
    """

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor  # int64 [N]; 0 = off
    top_p: torch.Tensor  # float32 [N]; 1 = off
    min_p: torch.Tensor  # float32 [N]; 0 = off
    generators: list[torch.Generator | None]  # per row; None = the sampler's shared generator
    all_greedy: bool = False  # True: every temperature is 0, so sampling is a plain argmax
    needs_sort: bool = True  # False: no row uses top-k or top-p, so no sort is needed
    uses_min_p: bool = True  # False: every min_p is 0, so no row is masked by it
    # the rows with temperature > 0, ascending (None: unknown, any row may be sampled)
    sampled_rows: tuple[int, ...] | None = None

    @classmethod
    def from_params(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Validate host-side lists and build the batch with one small tensor per parameter.

        Greedy rows drop their generator: they never draw, so a seeded greedy request's generator is
        left untouched.
        """
        n = len(temperature)
        gens = [None] * n if generators is None else list(generators)
        for name, values in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} rows, temperature has {n}")
        if len(gens) != n:
            raise ValueError(f"generators has {len(gens)} rows, temperature has {n}")
        _check_range("temperature", temperature, lambda t: t >= 0.0, ">= 0 (0 = greedy)")
        _check_range("top_k", top_k, lambda k: k >= 0, ">= 0 (0 = off)")
        _check_range("top_p", top_p, lambda p: 0.0 < p <= 1.0, "in (0, 1] (1 = off)")
        _check_range("min_p", min_p, lambda p: 0.0 <= p <= 1.0, "in [0, 1] (0 = off)")
        greedy = [t == 0.0 for t in temperature]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            generators=[None if g_row else gen for g_row, gen in zip(greedy, gens, strict=True)],
            all_greedy=all(greedy),
            needs_sort=any(
                not g_row and (k > 0 or p < 1.0)
                for g_row, k, p in zip(greedy, top_k, top_p, strict=True)
            ),
            uses_min_p=any(not g_row and p > 0.0 for g_row, p in zip(greedy, min_p, strict=True)),
            sampled_rows=tuple(i for i, g_row in enumerate(greedy) if not g_row),
        )

    def take(self, rows: Sequence[int]) -> SamplingBatch:
        """The batch of the given rows only (host-side hints kept conservative)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        sampled = set(self.sampled_rows) if self.sampled_rows is not None else None
        return SamplingBatch(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            min_p=self.min_p[index],
            generators=[self.generators[r] for r in rows],
            all_greedy=self.all_greedy,
            needs_sort=self.needs_sort,
            uses_min_p=self.uses_min_p,
            sampled_rows=None
            if sampled is None
            else tuple(i for i, r in enumerate(rows) if r in sampled),
        )


def _check_range(
    name: str, values: Sequence[float], ok: Callable[[float], bool], rule: str
) -> None:
    for i, value in enumerate(values):
        if not ok(value):  # NaN fails every rule
            raise ValueError(f"{name} must be {rule}, got {value} at row {i}")


def derive_seed(seed: int, *parts: int) -> int:
    """The one derivation of a seed from a request's seed: what a seeded sample draws at some
    place (its sample index, output position, ...) depends on (seed, *parts) alone, never on
    the batch around it."""
    return hash((seed, *parts)) & 0x7FFF_FFFF_FFFF_FFFF


def seeded_generator(device: torch.device, seed: int, *parts: int) -> torch.Generator:
    """A generator of its own for (seed, *parts): ``derive_seed``."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, *parts))


_ARGMAX_BLOCK, _ARGMAX_MIN_ROWS = 1024, 16


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D tensor, bit for bit: the lowest index of each row's maximum
    (of its first NaN where it has one, as torch counts NaN the largest).

    On the CPU torch's argmax reduction runs at ~1.5 G elements/s ([32, 49152] logits: 0.9 ms
    in a loop) while amax is vectorised (0.05 ms). So: each row's 1024-wide block maxima, the
    first block holding the row's maximum, the argmax within it (0.14 ms in a loop); a short
    last block is read with its final column repeated, which ``argmax``'s first-occurrence
    rule makes harmless. In the engine, right after a forward, its ten small ops cost ~0.3 ms
    more: at 32 rows it took 0.61 ms to torch's 0.98, at 16 rows 0.49 to 0.55, at 8 rows 0.42
    to 0.30; hence torch's below ``_ARGMAX_MIN_ROWS``.
    """
    rows, n = x.shape
    if x.device.type != "cpu" or rows < _ARGMAX_MIN_ROWS or n < 2 * _ARGMAX_BLOCK:
        return x.argmax(-1)
    full = n // _ARGMAX_BLOCK * _ARGMAX_BLOCK
    maxima = x[:, :full].unflatten(-1, (-1, _ARGMAX_BLOCK)).amax(-1)
    if full < n:
        maxima = torch.cat([maxima, x[:, full:].amax(-1, keepdim=True)], -1)
    start = maxima.argmax(-1, keepdim=True) * _ARGMAX_BLOCK
    columns = (start + torch.arange(_ARGMAX_BLOCK)).clamp_(max=n - 1)
    return columns.gather(1, x.gather(1, columns).argmax(-1, keepdim=True)).squeeze(1)


def processed_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p, renormalised: float32 [N, V].

    Greedy rows (temperature 0) become one-hot at the argmax, lowest id on ties. This is the
    distribution the rejection sampler must see as p (and q) to keep speculation lossless.
    Top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest prefix of
    the sorted distribution whose mass reaches top_p.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(
            f"logits must be [N, V] with N = {batch.temperature.shape[0]} rows, "
            f"got shape {tuple(logits.shape)}"
        )
    logits = logits.float()
    sampled = batch.sampled_rows
    has_greedy = batch.all_greedy or sampled is None or len(sampled) < logits.shape[0]
    temperature = batch.temperature
    if has_greedy:
        one_hot = torch.zeros_like(logits).scatter_(1, argmax_rows(logits)[:, None], 1.0)
        if batch.all_greedy:
            return one_hot
        greedy = temperature == 0
        temperature = torch.where(greedy, 1.0, temperature)
    # subtracting the max first keeps a tiny temperature from overflowing to inf (and NaN)
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature[:, None]
    if batch.needs_sort:
        scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = scaled.softmax(-1)
    if batch.uses_min_p:
        # min-p compares each prob to the max; that ratio survives the renormalisation above,
        # so applying it last equals applying it to the top-k/top-p distribution
        keep = probs >= batch.min_p[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if not has_greedy:
        return probs
    return torch.where(greedy[:, None], one_hot, probs)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and then top-p set to -inf (one sort for both)."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the first token has 0 < top_p before it: always kept
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ordered)


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


class Sampler:
    """Turns logits [N, V] into one token per row; owns the generator for unseeded rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token id per row: int64 [N]."""
        if batch.all_greedy:
            return argmax_rows(logits)  # no randomness consumed
        rows = batch.sampled_rows
        if rows is None or len(rows) == logits.shape[0]:
            probs = processed_probs(logits, batch)
            return sample_from_probs(probs, batch.generators, self.generator)
        # greedy rows: the argmax (what sampling their one-hot rows returns), and they draw nothing
        tokens = argmax_rows(logits)
        sub = batch.take(rows)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        probs = processed_probs(logits[index], sub)
        tokens[index] = sample_from_probs(probs, sub.generators, self.generator)
        return tokens


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[dict[int, float]]:
    """Logprobs as vLLM reports them: of the raw model distribution (log_softmax of the logits
    before penalties, temperature, top-k/p, min-p or min_tokens masking), for ``token_ids[j]``
    at row j, plus the ``num_top`` most likely ids of each row. One dict per row:
    {token id: Logprob} (its rank: 1 + the tokens more likely; no decoded token yet)."""
    picked = torch.tensor(token_ids, device=logits.device)
    return logprob_entries(logprob_tensors(logits[: len(token_ids)], picked, num_top), token_ids)


LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobTensors:
    """``token_logprobs``' figures on the device, unread: each row's logprob of its token and
    its rank, and the ``num_top`` largest logprobs with their ids."""
    rows = logits.float().log_softmax(-1)
    picked = rows.gather(1, token_ids[:, None])[:, 0]
    ranks = (rows > picked[:, None]).sum(-1) + 1
    top = rows.topk(min(num_top, rows.shape[-1]), dim=-1)
    return picked, ranks, top.values, top.indices


def logprob_entries(tensors: LogprobTensors, token_ids: Sequence[int]) -> list[dict[int, float]]:
    """``logprob_tensors`` read into ``token_logprobs``' dicts."""
    picked, ranks, values, indices = (t.tolist() for t in tensors)
    result = [{t: Logprob(lp, rank)} for t, lp, rank in zip(token_ids, picked, ranks, strict=True)]
    for entry, ids, lps in zip(result, indices, values, strict=True):
        entry.update(
            (t, entry[t] if t in entry else Logprob(lp, rank))
            for rank, (t, lp) in enumerate(zip(ids, lps, strict=True), 1)
        )
    return result
