"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Accept draft x with probability min(1, p(x)/q(x)); at the first rejection emit a sample of
norm(max(0, p − q)) and stop; if every draft is accepted emit a bonus sample of p. The emitted
tokens are then distributed exactly as if sampled from the target one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedspec.engine.sample.draws import draw_rows, inverse_cdf, uniform_draws

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
    generator: Generators = None,
) -> torch.Tensor:
    """Verify drafts for S sequences at once; returns long [S, K+1].

    target_probs: float [S, K+1, V], the (processed) target distribution at each draft position,
        then the bonus position. Row s's bonus distribution is target_probs[s, num_draft_tokens[s]].
    draft_token_ids: long [S, K]; positions >= num_draft_tokens[s] are ignored (may be garbage).
    draft_probs: float [S, K, V], the (processed) draft distribution q; None means deterministic
        drafts (q one-hot: accept with p(x), recover from p with x removed).
    num_draft_tokens: long [S], clamped to [0, K]; None means K for every row.
    generator: one generator for the whole batch (None = torch's default), or a list with one entry
        per row. Rows that share a generator object draw together; a row with a generator of its
        own draws exactly K + 1 float64 uniforms from it per call (K ratio tests, then the last
        token's), so a seeded row's tokens do not depend on the other rows in the batch (for a
        fixed K).

    Output row s: the accepted drafts, then one recovered or bonus token, then -1 padding. Ids are
    always in [0, V): a valid draft id outside [0, V) counts as p(x) = 0 and is rejected.
    Vectorised over S and K with no host synchronisation.
    """
    if target_probs.dim() != 3 or target_probs.shape[1] < 1:
        raise ValueError(
            f"target_probs must be [S, K+1, V] with K >= 0, got shape {tuple(target_probs.shape)}"
        )
    num_seqs, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    if tuple(draft_token_ids.shape) != (num_seqs, k):
        raise ValueError(
            f"draft_token_ids must be [S, K] = [{num_seqs}, {k}], "
            f"got shape {tuple(draft_token_ids.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_seqs, k, vocab):
        raise ValueError(
            f"draft_probs must be [S, K, V] = [{num_seqs}, {k}, {vocab}], "
            f"got shape {tuple(draft_probs.shape)}"
        )
    if num_draft_tokens is None:
        num_drafts = torch.full((num_seqs,), k, dtype=torch.long, device=device)
    elif tuple(num_draft_tokens.shape) != (num_seqs,):
        raise ValueError(
            f"num_draft_tokens must be [S] = [{num_seqs}], "
            f"got shape {tuple(num_draft_tokens.shape)}"
        )
    else:
        num_drafts = num_draft_tokens.to(device=device, dtype=torch.long).clamp(0, k)
    if not isinstance(generator, torch.Generator) and generator is not None:
        generator = list(generator)
        if len(generator) != num_seqs:
            raise ValueError(
                f"generator list has {len(generator)} entries, expected S = {num_seqs}"
            )

    uniforms = _draw(num_seqs, k, generator, device)  # [S, K + 1]

    drafts = draft_token_ids.to(device=device, dtype=torch.long)
    valid = torch.arange(k, device=device) < num_drafts[:, None]  # [S, K]
    in_vocab = (drafts >= 0) & (drafts < vocab)
    # invariant: safe_drafts is a legal index everywhere and equals the draft where it is used
    safe_drafts = torch.where(valid & in_vocab, drafts, 0)
    p_draft = target_probs[:, :k].gather(2, safe_drafts[..., None]).squeeze(-1).double()
    p_draft = p_draft * in_vocab
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, safe_drafts[..., None]).squeeze(-1).double()
    # u ~ U[0, 1): P(u * q < p) = min(1, p / q), and p = 0 is never accepted, not even at u = 0
    accepted = (uniforms[:, :k] * q_draft < p_draft) & valid
    num_accepted = accepted.long().cumprod(1).sum(1)  # [S], in [0, num_drafts]

    # the last emitted token is drawn from position num_accepted: recovered if that position held
    # a rejected draft, bonus if every draft was accepted
    rows = torch.arange(num_seqs, device=device)
    p_last = target_probs[rows, num_accepted].float()
    rejected = (num_accepted < num_drafts)[:, None]
    if k == 0:
        q_last = torch.zeros_like(p_last)
    elif draft_probs is None:
        rejected_pos = num_accepted.clamp(max=k - 1)[:, None]
        rejected_id = safe_drafts.gather(1, rejected_pos)
        in_vocab_at = in_vocab.gather(1, rejected_pos)
        q_last = torch.zeros_like(p_last).scatter_(1, rejected_id, in_vocab_at.float())
    else:
        q_last = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
    last_token = inverse_cdf(_recovery_weights(p_last, q_last * rejected), uniforms[:, k])

    positions = torch.arange(k + 1, device=device)[None, :]
    padded_drafts = torch.cat([safe_drafts, safe_drafts.new_zeros(num_seqs, 1)], dim=1)
    out = torch.where(positions < num_accepted[:, None], padded_drafts, -1)
    return torch.where(positions == num_accepted[:, None], last_token[:, None], out)


def _recovery_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q), unnormalised (sampling needs no normalisation); p itself where that is all 0.

    q is all zero for rows that emit a bonus token, which then sample p.
    """
    residual = (p - q).clamp_min(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)


def _draw(
    num_seqs: int,
    k: int,
    generator: torch.Generator | list[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:
    """Float64 uniforms [S, K + 1]: K for the ratio tests, then one for the last token."""

    def draw(m: int, gen: torch.Generator | None) -> tuple[torch.Tensor]:
        return (uniform_draws((m, k + 1), device, gen),)

    if isinstance(generator, list):
        return draw_rows(generator, draw)[0]
    return draw(num_seqs, generator)[0]


def verify_deterministic_drafts(
    samples: Sequence[int], drafts: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[list[int]]:
    """Rejection sampling for deterministic drafts (q one-hot), given one target sample per row.

    ``samples[starts[s] + j]`` is a sample of p at draft position j of sequence s
    (j = len(drafts[s]) is the bonus position). Draft x is accepted iff the sample equals x,
    which happens with probability p(x) = min(1, p(x)/q(x)); at the first mismatch the sample is
    emitted: it is p conditioned on != x, i.e. norm(max(0, p − q)). So this is
    ``rejection_sample`` with ``draft_probs=None``, specialised. Its use: when each output
    position draws its sample from randomness of its own (a seeded request's per-position
    generator), the emitted tokens equal those of plain token-by-token sampling exactly,
    whatever was drafted or batched alongside.
    """
    out = []
    for draft, start in zip(drafts, starts, strict=True):
        emitted = []
        for j, x in enumerate(draft):
            emitted.append(samples[start + j])
            if emitted[-1] != x:
                break
        else:
            emitted.append(samples[start + len(draft)])
        out.append(emitted)
    return out
