"""Sampler: greedy, top-k / top-p / min-p support, sampling frequencies, seeds, logprobs."""

import math

import pytest
import torch
from stats import chi_square

from pagedspec.engine.sample.draws import inverse_cdf, sample_from_probs
from pagedspec.engine.sample.raw_logprobs import token_logprobs
from pagedspec.engine.sample.sampler import Sampler, SamplingBatch, argmax_rows, processed_probs


def naive_probs(logits: list[float], t: float, k: int, p: float, m: float) -> list[float]:
    """One row, float64, written straight from the definitions (the oracle)."""
    vocab = len(logits)
    if t == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [float(i == best) for i in range(vocab)]
    order = sorted(range(vocab), key=lambda i: -logits[i])
    kept = order[:k] if 0 < k < vocab else order
    weights = {i: math.exp((logits[i] - logits[order[0]]) / t) for i in kept}
    total = sum(weights.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if p < 1 and mass >= p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    top = max(weights[i] for i in nucleus)
    final = {i: weights[i] for i in nucleus if weights[i] >= m * top}
    total = sum(final.values())
    return [final.get(i, 0.0) / total for i in range(vocab)]


def random_params(n: int, gen: torch.Generator) -> tuple[list, list, list, list]:
    def pick(options: list, size: int) -> list:
        return [options[i] for i in torch.randint(0, len(options), (size,), generator=gen)]

    return (
        pick([0.0, 0.5, 1.0, 1.7], n),
        pick([0, 1, 5, 20, 64, 100], n),
        pick([1.0, 0.3, 0.8, 0.95], n),
        pick([0.0, 0.05, 0.2], n),
    )


def test_processed_probs_match_naive_per_row():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 300, 64
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature, top_k, top_p, min_p = random_params(n, gen)
    batch = SamplingBatch.from_params(temperature, top_k, top_p, min_p)
    probs = processed_probs(logits, batch)
    rows = [
        naive_probs(logits[i].tolist(), temperature[i], top_k[i], top_p[i], min_p[i])
        for i in range(n)
    ]
    expected = torch.tensor(rows, dtype=torch.float64)
    assert torch.equal(probs > 0, expected > 0)  # exactly the right support
    assert torch.allclose(probs.double(), expected, atol=1e-5)


def test_greedy_is_argmax_with_lowest_id_on_ties():
    gen = torch.Generator().manual_seed(1)
    n, vocab = 64, 50
    logits = torch.randint(0, 6, (n, vocab), generator=gen).float()  # many ties
    expected = [max(range(vocab), key=lambda i, r=row: (r[i], -i)) for row in logits.tolist()]
    sampler = Sampler(seed=1)
    all_greedy = SamplingBatch.from_params([0.0] * n, [0] * n, [1.0] * n, [0.0] * n)
    assert sampler(logits, all_greedy).tolist() == expected
    # mixed batch: greedy rows take the argmax, the others are sampled apart
    temperature = [0.0 if i % 2 else 1.0 for i in range(n)]
    mixed = SamplingBatch.from_params(temperature, [3] * n, [0.9] * n, [0.1] * n)
    got = sampler(logits, mixed).tolist()
    assert got[1::2] == expected[1::2]


@pytest.mark.parametrize("vocab", [100, 2048, 49152, 32000, 3000, 5 * 1024 + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_argmax_is_torch_argmax(vocab, dtype):
    """Bit for bit torch's argmax: ties (the first), maxima in the short last block or at its
    final column, NaN (the first NaN wins), rows all -inf, bf16 rows full of ties."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(24, vocab, generator=gen).to(dtype)
    x[1] = 0.0  # all tied
    x[2, [vocab // 3, vocab // 2]] = 100.0  # tie across blocks
    x[3, -1] = 100.0  # the last column
    x[4, vocab - 3 : vocab - 1] = 100.0  # tie inside the short last block
    x[5, [7, vocab // 2]] = float("nan")  # NaN beats everything, the first one
    x[6, [vocab // 2]] = float("nan")
    x[6, 3] = float("inf")
    x[7] = float("-inf")
    x[8] = torch.randint(0, 3, (vocab,), generator=gen).to(dtype)  # many ties
    x[9, vocab // 2 :] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    strided = x.t().contiguous().t()  # same values, column-major
    assert torch.equal(argmax_rows(strided), x.argmax(-1))
    assert torch.equal(argmax_rows(x[:3]), x[:3].argmax(-1))  # few rows: torch's own


def test_tiny_temperature_is_finite_and_picks_the_max():
    logits = torch.tensor([[1.0, 3.0, 2.999, -5.0], [100.0, -100.0, 0.0, 99.0]])
    batch = SamplingBatch.from_params([1e-8, 1e-8], [0, 2], [1.0, 0.5], [0.0, 0.0])
    probs = processed_probs(logits, batch)
    assert torch.isfinite(probs).all()
    assert torch.equal(Sampler()(logits, batch), torch.tensor([1, 0]))


def test_sampling_frequencies_match_processed_distribution():
    gen = torch.Generator().manual_seed(2)
    vocab, reps = 30, 25_000
    configs = [(0.6, 0, 1.0, 0.0), (1.3, 10, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (0.9, 0, 1.0, 0.1)]
    base = torch.randn(len(configs), vocab, generator=gen) * 2
    logits = base.repeat_interleave(reps, 0)
    columns = [[c[j] for c in configs for _ in range(reps)] for j in range(4)]
    batch = SamplingBatch.from_params(*columns)
    ids = Sampler(seed=2)(logits, batch).view(len(configs), reps)
    for i, config in enumerate(configs):
        expected = torch.tensor(naive_probs(base[i].tolist(), *config))
        stat, threshold = chi_square(torch.bincount(ids[i], minlength=vocab), expected)
        assert stat < threshold, (config, stat, threshold)


def test_seeded_row_is_the_same_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    row = torch.randn(1, vocab, generator=gen)
    others = torch.randn(5, vocab, generator=gen)

    def run(logits: torch.Tensor, params: list[tuple], seeds: list[int | None]) -> list[list[int]]:
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        batch = SamplingBatch.from_params(*zip(*params, strict=True), generators=gens)
        sampler = Sampler(seed=sum(len(p) for p in params))
        return [sampler(logits, batch).tolist() for _ in range(6)]

    alone = run(row, [(1.0, 0, 1.0, 0.0)], [7])
    params = [
        (0.8, 5, 1.0, 0.0),
        (0.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0),
        (1.2, 0, 1.0, 0.05),
        (0.5, 0, 1.0, 0.0),
    ]
    batched = run(torch.cat([others[:2], row, others[2:]]), params, [None, 5, 7, 8, None, None])
    assert [draw[0] for draw in alone] == [draw[2] for draw in batched]
    assert len({draw[0] for draw in alone}) > 1  # it really samples


def test_greedy_rows_consume_no_randomness():
    logits = torch.randn(3, 20)
    sampler = Sampler(seed=0)
    shared_before = sampler.generator.get_state()
    seeded = torch.Generator().manual_seed(11)
    seeded_before = seeded.get_state()

    def batch(temperature: list[float]) -> SamplingBatch:
        return SamplingBatch.from_params(
            temperature, [0] * 3, [1.0] * 3, [0.0] * 3, [seeded, None, None]
        )

    sampler(logits, batch([0.0, 0.0, 0.0]))
    assert torch.equal(sampler.generator.get_state(), shared_before)
    assert torch.equal(seeded.get_state(), seeded_before)
    sampler(logits, batch([0.0, 1.0, 1.0]))  # the seeded row is greedy: its generator is untouched
    assert torch.equal(seeded.get_state(), seeded_before)
    sampler(logits, batch([1.0, 0.0, 0.0]))  # control: a sampled seeded row does draw
    assert not torch.equal(seeded.get_state(), seeded_before)


def test_logprobs_are_raw_log_softmax_at_given_ids():
    gen = torch.Generator().manual_seed(4)
    n, vocab = 32, 100
    logits = torch.randn(n, vocab, generator=gen) * 2
    ids = torch.randint(vocab, (n,), generator=gen).tolist()
    raw = logits.double().log_softmax(-1)
    for num_top in (0, 3):
        entries = token_logprobs(logits, ids, num_top)
        for row, (entry, token) in enumerate(zip(entries, ids, strict=True)):
            expected = {token: raw[row, token].item()}
            top = raw[row].topk(num_top)
            expected.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            assert entry.keys() == expected.keys()
            assert all(abs(entry[t] - expected[t]) < 1e-5 for t in entry)


def test_padding_lanes_and_zero_weights_are_never_sampled():
    gen = torch.Generator().manual_seed(5)
    n, vocab, real_vocab = 20_000, 40, 33
    logits = torch.randn(n, vocab, generator=gen)
    logits[:, real_vocab:] = float("-inf")  # vocabulary padding
    batch = SamplingBatch.from_params([2.0] * n, [0] * n, [1.0] * n, [0.0] * n)
    ids = Sampler(seed=5)(logits, batch)
    assert ids.max() < real_vocab and ids.min() >= 0
    weights = torch.zeros(n, vocab)
    weights[:, 4], weights[:, 9] = 3.0, 1.0  # unnormalised on purpose
    ids = sample_from_probs(weights, [None] * n, gen)
    counts = torch.bincount(ids, minlength=vocab)
    stat, threshold = chi_square(counts, weights[0] / 4)
    assert stat < threshold


@pytest.fixture(params=["two levels", "one level"])
def cdf_levels(request, monkeypatch):
    """Run an inverse_cdf test through each of its paths, whatever the size of its weights."""
    limit = 0 if request.param == "two levels" else 1 << 62
    monkeypatch.setattr("pagedspec.engine.sample.draws._ONE_LEVEL_MAX_WEIGHTS", limit)


def batched_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """inverse_cdf over 20k rows at a time (the one level holds a float64 copy of them)."""
    pieces = zip(weights.split(20_000), uniforms.split(20_000), strict=True)
    return torch.cat([inverse_cdf(w, u) for w, u in pieces])


def test_inverse_cdf_over_many_chunks_follows_the_weights(cdf_levels):
    """A vocabulary of several first-level chunks, not a multiple of the chunk (so padded),
    with empty chunks (the first and the last among them), a heavy lane and a tiny one:
    frequencies follow w / sum(w), and u = 0 and u = 1 land on the first and last lanes with
    weight, never in an empty chunk."""
    gen = torch.Generator().manual_seed(11)
    vocab = 1100  # chunks of 256: [0, 256) ... [1024, 1100) + padding
    w = torch.rand(vocab, generator=gen) ** 4
    w[:300] = 0.0  # chunk 0 empty, chunk 1 starts with zeros
    w[600:700] = 0.0
    w[1000:] = 0.0  # the last chunk empty
    w[700] = 5.0
    w[513] = 1e-3
    n = 400_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=gen)
    ids = batched_inverse_cdf(w.expand(n, vocab), uniforms)
    stat, threshold = chi_square(torch.bincount(ids, minlength=vocab), w.double() / w.sum())
    assert stat < threshold
    edges = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert inverse_cdf(w.expand(2, vocab), edges).tolist() == [300, 999]


def test_inverse_cdf_keeps_rows_apart_and_small_lanes_and_bad_rows_defined(cdf_levels):
    vocab, n = 1100, 3000
    w = torch.zeros(3, vocab)
    w[0, 10:20] = 1.0  # chunk 0 only
    w[1, 900] = 1.0  # chunk 3 only
    w[2, 1050], w[2, 5] = 2.0, 1.0  # the padded last chunk and chunk 0
    gen = torch.Generator().manual_seed(12)
    rows = torch.arange(3).repeat(n)
    ids = inverse_cdf(w[rows], torch.rand(3 * n, dtype=torch.float64, generator=gen)).view(n, 3)
    assert ((ids[:, 0] >= 10) & (ids[:, 0] < 20)).all() and (ids[:, 1] == 900).all()
    assert set(ids[:, 2].tolist()) == {5, 1050}
    # a lane far below float32's resolution of its chunk's sum still owns its interval
    tiny = torch.zeros(1, 256)
    tiny[0, 0], tiny[0, 1] = 0.5, 1e-9
    top = torch.tensor([1.0 - 1e-12], dtype=torch.float64)
    assert inverse_cdf(tiny, top).tolist() == [1]
    # rows with no weight, or a NaN, give 0; no rows, no ids
    bad = torch.zeros(2, vocab)
    bad[1, 7] = float("nan")
    assert inverse_cdf(bad, torch.tensor([0.3, 0.9], dtype=torch.float64)).tolist() == [0, 0]
    assert inverse_cdf(torch.zeros(0, vocab), torch.zeros(0, dtype=torch.float64)).shape == (0,)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.2),
        ("min_p", 1.1),
    ],
)
def test_bad_parameters_raise_naming_the_field(field, value):
    params = {"temperature": [1.0, 1.0], "top_k": [0, 0], "top_p": [1.0, 1.0], "min_p": [0.0, 0.0]}
    params[field] = [params[field][0], value]
    with pytest.raises(ValueError, match=field):
        SamplingBatch.from_params(**params)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="top_k"):
        SamplingBatch.from_params([1.0, 1.0], [0], [1.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.from_params([1.0], [0], [1.0], [0.0], generators=[None, None])
    with pytest.raises(ValueError, match="logits"):
        processed_probs(torch.zeros(3, 5), SamplingBatch.from_params([1.0], [0], [1.0], [0.0]))
