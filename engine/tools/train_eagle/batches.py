"""Draft vocabulary, train/held-out split and padded batches of conversations for the head."""

from __future__ import annotations

import random

import torch

IGNORE = -100


def choose_draft_vocab(convs: list[dict], target_vocab: int, size: int) -> torch.Tensor:
    """d2t: the ``size`` most frequent answer tokens (ties and shortfalls broken by prompt-token
    frequency, then by lowest id), as target ids sorted ascending."""
    if size > target_vocab:
        raise ValueError(f"draft vocab size {size} exceeds the target vocab {target_vocab}")
    answers = torch.zeros(target_vocab, dtype=torch.long)
    prompts = torch.zeros(target_vocab, dtype=torch.long)
    for c in convs:
        tokens, p = c["tokens"], c["prompt_len"]
        answers += torch.bincount(tokens[p:], minlength=target_vocab)
        prompts += torch.bincount(tokens[:p], minlength=target_vocab)
    ids = torch.arange(target_vocab)
    # lexicographic (answers desc, prompts desc, id asc) via a stable sort on each key, last first
    order = ids
    for key in (prompts, answers):
        order = order[torch.sort(-key[order], stable=True).indices]
    return torch.sort(order[:size]).values


def target_to_draft(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    t2d = torch.full((target_vocab,), IGNORE, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


def split(convs: list[dict], heldout_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle; at least one conversation is held out."""
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    n = max(1, round(heldout_fraction * len(convs))) if len(convs) > 1 else 0
    return [convs[i] for i in order[n:]], [convs[i] for i in order[:n]]


def epoch_batches(num: int, batch_size: int, seed: int, epoch: int, lengths: list[int]):
    """Index lists for one epoch: a seeded shuffle, cut into groups of 8 batches that are sorted
    by length (less padding), then the batches themselves shuffled."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(num))
    rng.shuffle(order)
    group = 8 * batch_size
    batches = []
    for g in range(0, num, group):
        part = sorted(order[g : g + group], key=lambda i: lengths[i])
        batches += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def make_batch(convs: list[dict], embed: torch.Tensor, t2d: torch.Tensor, max_len: int) -> dict:
    """Right-padded tensors for a list of conversations.

    ``mask[b, i]``: position i is trained (its next token i+1 is an answer token);
    ``labels[b, i]``: draft id of token i+1 (IGNORE outside the draft vocab or off the mask);
    ``next_tokens[b, i]``: target id of token i+1 (or -1)."""
    lengths = [min(len(c["tokens"]), max_len) for c in convs]
    width = max(lengths)
    hidden = convs[0]["features"].shape[1]
    tokens = torch.zeros(len(convs), width, dtype=torch.long)
    feats = torch.zeros(len(convs), width, hidden)
    mask = torch.zeros(len(convs), width, dtype=torch.bool)
    next_tokens = torch.full((len(convs), width), -1, dtype=torch.long)
    greedy = torch.tensor([c["temperature"] == 0 for c in convs])
    for b, (c, n) in enumerate(zip(convs, lengths, strict=True)):
        tokens[b, :n] = c["tokens"][:n]
        feats[b, :n] = c["features"][:n].float()
        mask[b, max(c["prompt_len"] - 1, 0) : n - 1] = True
        next_tokens[b, : n - 1] = c["tokens"][1:n]
    labels = torch.where(mask, t2d[next_tokens.clamp(min=0)], IGNORE)
    return {
        "tokens": tokens,
        "embeds": embed[tokens],
        "features": feats,
        "mask": mask,
        "labels": labels,
        "next_tokens": next_tokens,
        "greedy": greedy,
    }
