"""Chain drafting, shared by the draft model and the EAGLE head: draw a draft per row (the
argmax, or a sample of q), feed it back, stop where the chain's confidence runs out, and place
a draft tree's leaves where their paths are likeliest."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedspec.engine.sample.draws import sample_from_probs
from pagedspec.engine.sample.grammar import fill_bitmasks, refused, words
from pagedspec.engine.sample.penalties import TokenHistory, apply_penalties
from pagedspec.engine.sample.sampler import SamplingBatch, processed_probs, seeded_generator
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.spec_decode.tree import DraftTree
from pagedspec.engine.worker.spans import Span
from pagedspec.scheduler import ScheduledSequence


def draw_drafts(
    logits: torch.Tensor,
    rows: list[tuple[TokenHistory, int]],
    generator: torch.Generator,
    token_map: torch.Tensor | None = None,
    grammar_bits: list[np.ndarray | None] | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft id per row of a draft model's logits, with q (its distribution processed like
    the target's: penalties, temperature, top-k, top-p, min-p): the argmax for greedy requests,
    else a sample of q. q is None when every row is greedy: a greedy draft's q is one-hot and
    verification reads none (at batch 1 building and sampling it cost half a head step).
    ``rows[i]`` = (the request's params and the tokens the draft follows, the draft's
    position); a seeded request draws from a generator of its own, seeded by (seed, position),
    so its drafts do not depend on the batch; the others share ``generator``.
    ``token_map``: the target id of each logit column (a reduced draft vocabulary).
    ``grammar_bits[i]``: the bitmask (int32 words, ``pagedspec.engine.sample.grammar``) of what row
    i's constraint allows after the drafts before it (None: unconstrained); a row draws from those
    tokens (from all where none is in the draft's vocabulary: that draft is then refused by the
    target's mask). ``vocab_size``: the target's (default: the logits' width)."""
    params = [h.params for h, _ in rows]
    # q only sets the acceptance rate (p is penalised exactly in the step sampler); penalising
    # it too keeps the drafts close to what the target will accept
    penalised = apply_penalties(logits, [h for h, _ in rows], token_map)
    for i, bits in enumerate(grammar_bits or ()):
        if bits is None:
            continue
        bad = refused(bits[None], vocab_size or logits.shape[-1])[0].to(logits.device)
        bad = bad[token_map] if token_map is not None else bad  # (token_map: on that device)
        if not bad.all():
            penalised = penalised.clone() if penalised is logits else penalised
            penalised[i].masked_fill_(bad, float("-inf"))
    if all(p.greedy for p in params):  # the argmax of the one-hot q, lowest id on ties
        return penalised.argmax(-1), None
    batch = SamplingBatch.from_params(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        device=logits.device,
    )
    q = processed_probs(penalised, batch)
    generators = [
        None if p.seed is None else seeded_generator(logits.device, p.seed, position, 1)
        for p, (_, position) in zip(params, rows, strict=True)
    ]
    return sample_from_probs(q, generators, generator), q


Forward = Callable[[list[Span], list[int]], torch.Tensor]
# (logits, rows, each row's constraint bitmask or None) -> (drafts, q): draw_drafts on a
# drafter's logits
Draw = Callable[
    [torch.Tensor, list[tuple[TokenHistory, int]], list[Any]], tuple[list[int], torch.Tensor | None]
]
# (rows of probabilities, how many, each row's draft): that many more of each row's top tokens,
# as (token, probability)
Alternatives = Callable[[torch.Tensor, int, list[int]], list[list[tuple[int, float]]]]


def chain_drafts(
    scheduled: list[ScheduledSequence],
    ks: list[int],
    params: list[SamplingParams | None],
    spans: list[Span],
    forward: Forward,
    draw: Draw,
    written: dict[int, tuple[int, list[int]]],
    chain_stop: float = 0.0,
    leaves: int = 0,
    alternatives: Alternatives | None = None,
    leaf_slots: list[int] | None = None,
    vocab_size: int = 0,
) -> tuple[list[list[int]], list[torch.Tensor | None], dict[int, DraftTree], dict[int, np.ndarray]]:
    """Chain drafting shared by the draft model and the EAGLE head: ``forward(spans, owners)``
    runs the drafter (``owners[j]`` = the scheduled index of span j; the first call gets
    ``spans``, one per scheduled sequence, with a logit row for each drafting one), ``draw``
    turns its logit rows into drafts and q; each draft but the last is fed back (and recorded
    in ``written``) until sequence i has ``ks[i]`` drafts or the product of its drafts' top-1
    probabilities (softmax of the raw logits) falls below ``chain_stop``.

    With ``leaves``, sequence i also gets up to min(leaves, ``leaf_slots[i]``) leaves of a
    DraftTree (``pagedspec.engine.spec_decode.tree``): ``alternatives`` gives each depth's next-best
    tokens (other than the chain's draft there), each scored by its path's probability, the product
    of the chain's top-1 probabilities above it times its own, and the best-scored are kept (ties:
    the shallower, then the higher-ranked). Returns the drafts (the chain, then any leaves by
    depth), per sequence q stacked where the chain was sampled (None where argmax), the trees,
    and per constrained sequence the bitmasks its chain was drawn under (row t: after its
    first t drafts; ``vocab_size`` wide, the target's), which verification reuses."""
    drafts: list[list[int]] = [[] for _ in scheduled]
    # per sequence: (-score, depth, rank, token) of each leaf candidate
    candidates: list[list[tuple[float, int, int, int]]] = [[] for _ in scheduled]
    probs: list[list[torch.Tensor]] = [[] for _ in scheduled]
    confidence = [1.0] * len(scheduled)  # the chain's path: its top-1 probabilities' product
    active = [i for i, k in enumerate(ks) if k]
    stop = {i: chain_stop for i in active}
    # a copy of a constrained sequence's matcher, advanced along its drafts as they are drawn;
    # a draft it refuses ends that chain
    grammars = [
        None if not k or (g := s.seq.owner.grammar) is None else g.deep_copy()
        for s, k in zip(scheduled, ks, strict=True)
    ]
    bits: dict[int, list[np.ndarray]] = {i: [] for i, g in enumerate(grammars) if g is not None}
    with_leaves = bool(leaves) and alternatives is not None and leaf_slots is not None
    logits = forward(spans, list(range(len(spans))))
    step = 0
    while active:
        rows = [(_history(scheduled[i], params[i], drafts[i]), scheduled[i].start + 1 + step)
                for i in active]  # fmt: skip
        for i in active:
            if i in bits:
                row = np.empty((1, words(vocab_size)), np.int32)
                fill_bitmasks(grammars[i], (), row)
                bits[i].append(row[0])
        tokens, q = draw(logits, rows, [bits[i][-1] if i in bits else None for i in active])
        if with_leaves or any(stop[i] > 0 for i in active):
            head_probs = torch.softmax(logits.float(), -1)
            if with_leaves:
                more = alternatives(head_probs, leaves, tokens)
                for j, i in enumerate(active):
                    candidates[i] += [(-confidence[i] * p, step + 1, rank, token)
                                      for rank, (token, p) in enumerate(more[j])]  # fmt: skip
            top = head_probs.amax(-1).tolist()
            for j, i in enumerate(active):
                confidence[i] *= top[j]
        for j, i in enumerate(active):
            drafts[i].append(tokens[j])
            if q is not None:  # None: every row greedy, and greedy drafts keep no q
                probs[i].append(q[j])
            if grammars[i] is None:
                continue
            if not (
                grammars[i].validate_tokens([tokens[j]]) and grammars[i].consume_token(tokens[j])
            ):
                stop[i] = math.inf
        active = [i for i in active if len(drafts[i]) < ks[i] and confidence[i] >= stop[i]]
        if not active:
            break
        spans = []
        for i in active:
            s = scheduled[i]
            written[s.seq.seq_id][1].append(drafts[i][-1])
            spans.append(Span([drafts[i][-1]], s.start + 1 + step, 1, s.block_table))
        logits = forward(spans, active)
        step += 1
    sampled = [
        torch.stack(q) if p is not None and not p.greedy else None
        for p, q in zip(params, probs, strict=True)
    ]
    trees = {}
    for i, found in enumerate(candidates):
        if not found:
            continue
        kept = sorted(sorted(found)[: min(leaves, leaf_slots[i])], key=lambda c: c[1:3])
        if kept:
            trees[i] = DraftTree(len(drafts[i]), tuple(depth for _, depth, _, _ in kept))
            drafts[i] = drafts[i] + [token for *_, token in kept]
    return drafts, sampled, trees, {i: np.stack(rows) for i, rows in bits.items() if rows}


def _history(s: ScheduledSequence, params: SamplingParams, drafts: list[int]) -> TokenHistory:
    """A draft follows the sequence's tokens and the drafts chained before it."""
    return TokenHistory(params, s.seq.token_ids, s.seq.num_prompt_tokens, tuple(drafts))
