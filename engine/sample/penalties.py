"""Presence, frequency and repetition penalties (vLLM's / OpenAI's), vectorised over a step.

For a logit row that follows prompt P and generated tokens O, with c[t] the count of t in O:

    if t in P or O:  l[t] = l[t] / r  if l[t] > 0  else  l[t] * r      (r = repetition_penalty)
    l[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)

on the raw logits, before temperature, top-k, top-p and min-p (vLLM's order). Logprobs stay
those of the raw logits (vLLM's default ``raw_logprobs``):
``pagedspec.engine.sample.raw_logprobs.token_logprobs``.

Under speculation row j of a verification span is the target's distribution once drafts
d_0..d_{j-1} are accepted, so its O ends with them: counting only the committed outputs would
give the verifier a p that no plain decode samples from, and speculation would stop being
lossless.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.worker.spans import with_pending


@dataclass(frozen=True)
class TokenHistory:
    """What one span of consecutive logit rows follows.

    The span's last row follows ``token_ids`` then every draft, each row before it one draft
    fewer: a verification span has ``len(drafts) + 1`` rows and row j follows ``drafts[:j]``;
    a drafter's row follows all the drafts chained so far.
    """

    params: SamplingParams
    token_ids: Sequence[int]  # the prompt, then the committed generated tokens
    num_prompt_tokens: int
    drafts: Sequence[int] = ()
    num_rows: int = 1


def apply_penalties(
    logits: torch.Tensor,
    histories: Sequence[TokenHistory],
    token_map: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logits`` [R, V] with each row's penalties applied, as a new tensor (``logits`` itself,
    untouched, when no history uses penalties: the common case costs one pass over the params).

    ``histories`` cover the rows in order. ``token_map`` [V]: the token id of each column (a
    drafter's reduced vocabulary); None: column c is token c. ``pending``: the tokens that a
    history's placeholders ``-1 - i`` stand for (``pagedspec.engine.worker.spans.with_pending``).
    """
    if sum(h.num_rows for h in histories) != logits.shape[0]:
        raise ValueError(f"histories cover {sum(h.num_rows for h in histories)} rows, "
                         f"logits has {logits.shape[0]}")  # fmt: skip
    starts = itertools.accumulate((h.num_rows for h in histories), initial=0)
    chosen = [
        (h, start) for h, start in zip(histories, starts, strict=False) if h.params.has_penalties
    ]  # starts has one more entry than histories
    if not chosen:
        return logits
    for h, _ in chosen:
        if not 1 <= h.num_rows <= len(h.drafts) + 1:
            raise ValueError(f"num_rows must be in [1, {len(h.drafts) + 1}], got {h.num_rows}")
    rows = torch.tensor(
        [start + j for h, start in chosen for j in range(h.num_rows)], device=logits.device
    )
    picked = logits if len(rows) == logits.shape[0] else logits[rows]
    penalised = _penalise(picked, [h for h, _ in chosen], token_map, pending)
    if len(rows) == logits.shape[0]:
        return penalised
    return logits.index_copy(0, rows, penalised)


def _penalise(
    logits: torch.Tensor,
    histories: list[TokenHistory],
    token_map: torch.Tensor | None,
    pending: torch.Tensor | None,
) -> torch.Tensor:
    """Every row of these histories penalised. Only the logits of seen tokens change, so the
    work is on [rows, L] (L the longest history) plus one copy of the logits: one padded
    [spans, L] tensor of the histories' tokens, gathered per row and masked to the positions
    the row follows (its prompt, its outputs, the drafts before it)."""
    device, num_spans = logits.device, len(histories)
    num_columns = logits.shape[1]
    # column_of[t]: the logit column of token t, -1 for none (padding; outside a token map)
    if token_map is None:
        width = num_columns
        column_of = torch.arange(width + 1, device=device)
    else:
        width = int(token_map.max()) + 1
        column_of = torch.zeros(width + 1, dtype=torch.long, device=device)
        column_of[token_map] = torch.arange(1, num_columns + 1, device=device)
        column_of -= 1
    column_of[width] = -1
    lengths = torch.tensor([len(h.token_ids) + len(h.drafts) for h in histories], device=device)
    positions = torch.arange(int(lengths.max()), device=device)
    padded = torch.full((num_spans, len(positions)), width, dtype=torch.long, device=device)
    flat = itertools.chain.from_iterable(itertools.chain(h.token_ids, h.drafts) for h in histories)
    padded[positions < lengths[:, None]] = torch.tensor(list(flat), device=device)
    if pending is not None:
        padded = with_pending(padded, pending)

    num_rows = torch.tensor([h.num_rows for h in histories], device=device)
    span = torch.repeat_interleave(torch.arange(num_spans, device=device), num_rows)
    row_in_span = torch.arange(len(span), device=device) - (num_rows.cumsum(0) - num_rows)[span]
    # row j of a span leaves out the span's last num_rows - 1 - j drafts
    end = lengths[span] - (num_rows[span] - 1 - row_in_span)
    prompt_len = torch.tensor([h.num_prompt_tokens for h in histories], device=device)[span]
    columns = column_of[padded[span].clamp(max=width)]  # [R, L]
    seen = (positions < end[:, None]) & (columns >= 0)
    in_output = seen & (positions >= prompt_len[:, None])
    # unseen positions point at the row's first seen column (and so write what it writes);
    # a row that saw nothing points at column 0 and leaves it as it was
    anchor = columns.gather(1, seen.int().argmax(1, keepdim=True)).clamp(min=0)
    columns = torch.where(seen, columns, anchor)
    # how often each position's column occurs among the row's outputs, by binary search in the
    # row's sorted output columns (no dense [R, V] count to fill)
    outputs = torch.where(in_output, columns, num_columns).sort(1).values
    count = torch.searchsorted(outputs, columns, right=True) - torch.searchsorted(outputs, columns)
    count = count.to(logits.dtype)
    before = logits.gather(1, columns)

    def per_row(name: str) -> torch.Tensor:
        values = [getattr(h.params, name) for h in histories]
        return torch.tensor(values, dtype=logits.dtype, device=device)[span, None]

    r = per_row("repetition_penalty")
    after = torch.where(before > 0, before / r, before * r)
    after = after - per_row("frequency_penalty") * count - per_row("presence_penalty") * (count > 0)
    after = torch.where(seen.any(1, keepdim=True), after, before)
    return logits.scatter(1, columns, after)
