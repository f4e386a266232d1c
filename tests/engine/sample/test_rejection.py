"""Rejection sampler: exact output distribution, acceptance rate, deterministic drafts, layout."""

import pytest
import torch
from stats import chi_square

from pagedspec.engine.sample import rejection
from pagedspec.engine.spec_decode import rejection_sample


def dirichlet(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random distributions over the last axis with some mass near zero."""
    return normalised(torch.rand(shape, generator=gen, dtype=torch.float64) ** 2)


def peaked_dist(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random distributions with a dominant token (often 0.5-0.8 of the mass) and a long tail."""
    return torch.softmax(4 * torch.randn(shape, generator=gen, dtype=torch.float64), -1).float()


def normalised(w: torch.Tensor) -> torch.Tensor:
    return (w / w.sum(-1, keepdim=True)).float()


def sample_rows(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One id per row of probs [N, V] by inverse CDF (a test-side sampler, not the engine's)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(probs.shape[-1] - 1)


def test_two_token_example():
    """p = (0.7, 0.3), q = (0.4, 0.6): A always accepted, B half the time, recovery is A."""
    gen = torch.Generator().manual_seed(0)
    s = 200_000
    p = torch.tensor([0.7, 0.3]).expand(s, 2, 2)
    q = torch.tensor([0.4, 0.6]).expand(s, 1, 2)
    drafts = sample_rows(q[:, 0], gen)[:, None]
    out = rejection_sample(p, drafts, q, generator=gen)
    accepted = out[:, 0] == drafts[:, 0]
    is_a = drafts[:, 0] == 0
    assert accepted[is_a].all()
    assert abs(accepted[~is_a].double().mean().item() - 0.5) < 0.01
    assert (out[~accepted, 0] == 0).all() and (out[~accepted, 1] == -1).all()
    first = torch.bincount(out[:, 0], minlength=2).double() / s
    assert torch.allclose(first, torch.tensor([0.7, 0.3], dtype=torch.float64), atol=0.005)


def chained_case(num_seqs: int, vocab: int, k: int, gen: torch.Generator, peaked: bool = False):
    """Drafts from q with p and q at position j depending on the parity of the token before it.

    Returns (target_probs, drafts, draft_probs, num_drafts, p_tables) where p_tables[j][c] is
    the target at position j after a token of parity c (p_tables[0] has one entry). `peaked`:
    concentrated p and q = p² renormalised, so drafts that are checked as deterministic (accepted
    with p(x)) still get accepted often enough to fill every position.
    """
    make = peaked_dist if peaked else dirichlet
    p_tables = [make((1 + (j > 0), vocab), gen) for j in range(k + 1)]
    if peaked:
        q_tables = [normalised(p.double() ** 2) for p in p_tables[:k]]
    else:
        q_tables = [dirichlet((1 + (j > 0), vocab), gen) for j in range(k)]
    prev_parity = torch.zeros(num_seqs, dtype=torch.long)
    drafts, target, draft_probs = [], [], []
    for j in range(k + 1):
        target.append(p_tables[j][prev_parity])
        if j == k:
            break
        q = q_tables[j][prev_parity]
        draft_probs.append(q)
        drafts.append(sample_rows(q, gen))
        prev_parity = drafts[-1] % 2
    num_drafts = torch.randint(0, k + 1, (num_seqs,), generator=gen)
    drafts = torch.stack(drafts, 1)
    # ignored positions may hold garbage: poison them
    drafts = torch.where(torch.arange(k) < num_drafts[:, None], drafts, -1)
    return torch.stack(target, 1), drafts, torch.stack(draft_probs, 1), num_drafts, p_tables


MIN_ROWS = 200


def conditional_fits(out: torch.Tensor, p_tables: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Chi-square per position, given it is emitted and the parity of the token before it; a
    (position, parity) cell that fewer than MIN_ROWS rows reach is left out (a peaked target
    can make one parity rare, too rare for a chi-square test)."""
    vocab = p_tables[0].shape[-1]
    results = []
    for j, table in enumerate(p_tables):
        emitted = out[:, j] >= 0
        for parity, probs in enumerate(table):
            rows = emitted if j == 0 else emitted & (out[:, j - 1] % 2 == parity)
            if rows.sum() < MIN_ROWS:
                continue
            counts = torch.bincount(out[rows, j], minlength=vocab)
            results.append(chi_square(counts, probs))
    return results


@pytest.mark.parametrize("deterministic", [False, True])
def test_output_matches_target_and_broken_residual_is_caught(deterministic, monkeypatch):
    gen = torch.Generator().manual_seed(1 + deterministic)
    k, vocab = 3, 50
    target, drafts, draft_probs, num_drafts, p_tables = chained_case(
        100_000, vocab, k, gen, peaked=deterministic
    )
    q = None if deterministic else draft_probs
    out = rejection_sample(target, drafts, q, num_drafts, generator=gen)
    assert (out[:, k] >= 0).sum() > 1000  # every position is tested on enough rows
    fits = conditional_fits(out, p_tables)
    assert len(fits) > k  # of 2k + 1 (position, parity) cells; a peaked p leaves some rare
    assert all(stat < threshold for stat, threshold in fits), fits

    # the same check must reject a sampler that recovers from p instead of norm(max(0, p − q))
    monkeypatch.setattr(rejection, "_recovery_weights", lambda p, q: p)
    broken = rejection_sample(target, drafts, q, num_drafts, generator=gen)
    fits = conditional_fits(broken, p_tables)
    assert any(stat > threshold for stat, threshold in fits), fits


def test_expected_tokens_per_round_iid():
    """Same p, q at every position: E[tokens] = (1 − α^(n+1)) / (1 − α), α = Σ min(p, q)."""
    gen = torch.Generator().manual_seed(3)
    s, k, vocab = 200_000, 4, 50
    p, q = dirichlet((vocab,), gen), dirichlet((vocab,), gen)
    alpha = torch.minimum(p, q).double().sum().item()
    cdf = q.double().cumsum(0)
    u = torch.rand(s, k, generator=gen, dtype=torch.float64) * cdf[-1]
    drafts = torch.searchsorted(cdf, u, right=True).clamp_max(vocab - 1)
    num_drafts = torch.randint(0, k + 1, (s,), generator=gen)
    out = rejection_sample(
        p.expand(s, k + 1, vocab), drafts, q.expand(s, k, vocab), num_drafts, generator=gen
    )
    emitted = (out >= 0).sum(1).double()
    for n in range(k + 1):
        rows = num_drafts == n
        expected = (1 - alpha ** (n + 1)) / (1 - alpha)
        standard_error = emitted[rows].std().item() / rows.sum().sqrt().item()  # about 0.005
        assert abs(emitted[rows].mean().item() - expected) < 5 * standard_error + 1e-9
    counts = torch.bincount(out[:, 0], minlength=vocab)
    stat, threshold = chi_square(counts, p)
    assert stat < threshold


def one_hot_targets(argmax: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(argmax, vocab).float()


def test_greedy_targets_with_deterministic_drafts():
    gen = torch.Generator().manual_seed(4)
    s, k, vocab = 64, 5, 30
    best = torch.randint(0, vocab, (s, k + 1), generator=gen)
    target = one_hot_targets(best, vocab)

    out = rejection_sample(target, best[:, :k].clone(), generator=gen)
    assert torch.equal(out, best)  # every draft accepted, then the bonus argmax

    wrong = (best[:, :k] + torch.randint(1, vocab, (s, k), generator=gen)) % vocab
    out = rejection_sample(target, wrong, generator=gen)
    assert torch.equal(out[:, 0], best[:, 0]) and (out[:, 1:] == -1).all()

    num_right = torch.randint(0, k + 1, (s,), generator=gen)
    mixed = torch.where(torch.arange(k) < num_right[:, None], best[:, :k], wrong)
    out = rejection_sample(target, mixed, generator=gen)
    positions = torch.arange(k + 1)
    expected = torch.where(positions <= num_right[:, None], best, -1)
    assert torch.equal(out, expected)


def test_greedy_targets_with_probabilistic_drafts():
    """One-hot p: accept iff draft == argmax, whatever q says."""
    gen = torch.Generator().manual_seed(5)
    s, k, vocab = 256, 3, 20
    best = torch.randint(0, vocab, (s, k + 1), generator=gen)
    q = dirichlet((s, k, vocab), gen)
    drafts = torch.where(
        torch.rand(s, k, generator=gen) < 0.7,
        best[:, :k],
        sample_rows(q.view(-1, vocab), gen).view(s, k),
    )
    out = rejection_sample(one_hot_targets(best, vocab), drafts, q, generator=gen)
    right = (drafts == best[:, :k]).long().cumprod(1).sum(1)
    expected = torch.where(torch.arange(k + 1) <= right[:, None], best, -1)
    assert torch.equal(out, expected)


def test_zero_probability_draft_never_accepted_even_at_u_zero(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    s, vocab = 1_000_000, 4
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])  # lane 3 is vocabulary padding
    drafts = torch.zeros(s, 1, dtype=torch.long)
    out = rejection_sample(p.expand(s, 2, vocab), drafts, generator=gen)
    assert ((out[:, 0] == 1) | (out[:, 0] == 2)).all() and (out[:, 1] == -1).all()
    # float32 uniforms are too coarse for small ratios (and can be exactly 0): draws are float64
    uniforms = rejection._draw(2, 3, gen, torch.device("cpu"))
    assert uniforms.dtype == torch.float64 and uniforms.shape == (2, 4)

    def zero_uniforms(num_seqs, k, generator, device):
        return torch.zeros(num_seqs, k + 1, dtype=torch.float64)

    monkeypatch.setattr(rejection, "_draw", zero_uniforms)
    out = rejection_sample(p.expand(4, 2, vocab), torch.tensor([[0], [1], [2], [3]]))
    assert torch.equal(out[:, 0], torch.tensor([1, 1, 2, 1]))
    # u = 0 picks the first lane with weight: lane 1, never the zero-weight lane 0
    assert torch.equal(out[:, 1], torch.tensor([-1, 1, 1, -1]))


def test_identical_p_and_q_with_forced_rejection_samples_from_p(monkeypatch):
    """If max(0, p − q) is all zero the recovered token is drawn from p (never a 0-weight lane)."""
    gen = torch.Generator().manual_seed(7)
    s, vocab = 20_000, 10
    p = torch.zeros(vocab)
    p[3], p[7] = 0.25, 0.75
    real_draw = rejection._draw

    def reject_all(num_seqs, k, generator, device):
        uniforms = real_draw(num_seqs, k, generator, device)
        uniforms[:, :k] = 1.0  # u = 1: u·q < p fails when p = q
        return uniforms

    monkeypatch.setattr(rejection, "_draw", reject_all)
    drafts = torch.full((s, 1), 7)
    out = rejection_sample(p.expand(s, 2, vocab), drafts, p.expand(s, 1, vocab), generator=gen)
    assert (out[:, 1] == -1).all()
    stat, threshold = chi_square(torch.bincount(out[:, 0], minlength=vocab), p)
    assert stat < threshold


def test_layout_ids_in_range_and_out_of_vocab_drafts():
    gen = torch.Generator().manual_seed(8)
    s, k, vocab, real_vocab = 4096, 4, 40, 32
    target = dirichlet((s, k + 1, vocab), gen)
    target[..., real_vocab:] = 0.0  # padded lanes beyond the tokenizer's vocabulary
    target = target / target.sum(-1, keepdim=True)
    q = dirichlet((s, k, vocab), gen)
    drafts = torch.randint(0, real_vocab, (s, k), generator=gen)
    num_drafts = torch.randint(0, k + 1, (s,), generator=gen)
    drafts = torch.where(torch.arange(k) < num_drafts[:, None], drafts, 10**9)  # garbage
    drafts[:5, 0] = vocab + 3  # a valid draft outside the vocabulary is rejected
    num_drafts[:5] = k
    for draft_probs in (q, None):
        out = rejection_sample(target, drafts, draft_probs, num_drafts, generator=gen)
        assert out.shape == (s, k + 1) and out.dtype == torch.long
        assert (out < real_vocab).all()
        emitted = (out >= 0).sum(1)
        assert ((emitted >= 1) & (emitted <= num_drafts + 1)).all()
        positions = torch.arange(k + 1)
        assert torch.equal(out >= 0, positions < emitted[:, None])  # -1 only as a suffix
        accepted = positions[:k] < (emitted - 1)[:, None]
        assert torch.equal(out[:, :k][accepted], drafts[accepted])
        assert (emitted[:5] == 1).all()


def test_per_row_generators_make_seeded_rows_batch_independent():
    gen = torch.Generator().manual_seed(9)
    s, k, vocab = 16, 3, 100
    target, drafts, draft_probs, num_drafts, _ = chained_case(s, vocab, k, gen)

    def seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    gens = [seeded(100 + i) if i % 3 == 0 else gen for i in range(s)]
    batched = torch.stack(
        [
            rejection_sample(target, drafts, draft_probs, num_drafts, generator=gens)
            for _ in range(5)
        ]
    )
    for row in range(0, s, 3):
        alone_gen = [seeded(100 + row)]
        sl = slice(row, row + 1)
        alone = torch.stack(
            [
                rejection_sample(target[sl], drafts[sl], draft_probs[sl], num_drafts[sl], alone_gen)
                for _ in range(5)
            ]
        )
        assert torch.equal(alone[:, 0], batched[:, row])


def test_zero_drafts_and_k_zero_emit_a_bonus_from_p():
    gen = torch.Generator().manual_seed(10)
    s, vocab = 50_000, 8
    p = dirichlet((vocab,), gen)
    out = rejection_sample(
        p.expand(s, 1, vocab), torch.empty(s, 0, dtype=torch.long), generator=gen
    )
    stat, threshold = chi_square(torch.bincount(out[:, 0], minlength=vocab), p)
    assert out.shape == (s, 1) and stat < threshold
    target = torch.stack([dirichlet((vocab,), gen), p]).expand(s, 2, vocab)
    out = rejection_sample(
        target,
        torch.full((s, 1), -1),
        num_draft_tokens=torch.zeros(s, dtype=torch.long),
        generator=gen,
    )
    stat, threshold = chi_square(torch.bincount(out[:, 0], minlength=vocab), target[0, 0])
    assert (out[:, 1] == -1).all() and stat < threshold


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_probs": torch.ones(2, 3)}, "target_probs"),
        ({"draft_token_ids": torch.zeros(2, 3, dtype=torch.long)}, "draft_token_ids"),
        ({"draft_probs": torch.ones(2, 1, 5)}, "draft_probs"),
        ({"num_draft_tokens": torch.ones(3, dtype=torch.long)}, "num_draft_tokens"),
        ({"generator": [None]}, "generator"),
    ],
)
def test_bad_shapes_raise(kwargs, field):
    args = {
        "target_probs": torch.full((2, 3, 4), 0.25),
        "draft_token_ids": torch.zeros(2, 2, dtype=torch.long),
    } | kwargs
    with pytest.raises(ValueError, match=field):
        rejection_sample(**args)
