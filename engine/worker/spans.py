"""Query spans, and one step's spans packed into the index arrays a forward reads.

Every sequence in a step contributes one span: a prefill chunk, a decode token, or the last
committed token followed by draft tokens. A large step is packed vectorised over the batch
(numpy: the only per-span Python is reading each span's fields once); a step of a few tokens
(a small decode batch, a drafter's chain step) in plain Python, which costs less there: numpy's
calls cost more than the loop they replace, and leave the caches colder for the model's
small ops that follow (on this CPU a 1-token forward of tiny-llama took 10 us longer after
packing with numpy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pagedspec.kernels.tree_mask import tree_mask_of
from pagedspec.memory import slot_mapping, slot_of


class Span(NamedTuple):
    """``token_ids`` sit at positions ``start..start+len-1`` of a sequence whose KV blocks are
    ``block_table``; the logits of the last ``num_logits`` of them are returned.

    With ``parents`` the span is a token tree (a draft tree): token j follows token
    ``parents[j]`` (< j; -1 for token 0), sees only its ancestors and itself among the span's
    tokens, and takes position ``start + depth``; its K/V still go to slot ``start + j``.
    """

    token_ids: Sequence[int]
    start: int
    num_logits: int
    block_table: Sequence[int]
    parents: Sequence[int] | None = None


def with_pending(ids: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """``ids`` with each placeholder ``-1 - i`` (a token the host has not read yet: async
    scheduling, pagedspec.engine.core.async_step) replaced by ``pending[i]``, on the device."""
    return torch.where(ids < 0, pending[(-1 - ids).clamp(min=0)], ids)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth in a tree given as Span.parents (token 0: depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths


# Steps of at most this many tokens are packed in plain Python.
SMALL_STEP_TOKENS = 16

Index = np.ndarray | list  # a numpy array, or (a small step's) a list of the same values


class PackedSpans(NamedTuple):
    input_ids: Index  # int64 [T]
    positions: Index  # int64 [T]
    slots: Index  # int64 [T]
    logit_rows: Index | None  # int64 [R]: the rows whose logits are wanted; None: all
    cu_query_lens: Index  # int32 [S + 1]
    seq_lens: Index  # int32 [S]
    block_tables: Index  # int32 [S, max table length], zero-padded
    tree_mask: Index | None  # int64 [T] (kernels' tree_mask); None: every span causal


def pack_spans(spans: Sequence[Span], block_size: int) -> PackedSpans:
    if len(spans) <= SMALL_STEP_TOKENS and (
        sum(len(s.token_ids) for s in spans) <= SMALL_STEP_TOKENS
    ):
        return _pack_small(spans, block_size)
    return _pack_large(spans, block_size)


def _pack_large(spans: Sequence[Span], block_size: int) -> PackedSpans:
    """``pack_spans`` vectorised over the batch, as numpy arrays."""
    n = len(spans)
    token_ids, starts, num_logits, block_tables, parents = zip(*spans, strict=True)
    lens = np.fromiter(map(len, token_ids), np.int64, n)
    starts = np.array(starts, np.int64)
    num_logits = np.array(num_logits, np.int64)
    widths = np.fromiter(map(len, block_tables), np.int64, n)
    ends = starts + lens
    past = np.flatnonzero(ends > widths * block_size)
    if past.size:
        i = int(past[0])
        raise ValueError(f"span {i} ends at {int(ends[i])}, past its block table")
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    rows = np.repeat(np.arange(n), lens)
    offsets = np.arange(total) - cu[rows]  # each token's index in its span
    linear = starts[rows] + offsets  # its slot's position (a tree token's too)
    tables = np.zeros((n, int(widths.max(initial=0))), np.int32)
    flat = itertools.chain.from_iterable(block_tables)
    tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
        flat, np.int32, int(widths.sum())
    )
    positions, tree_mask = linear, None
    if parents.count(None) != n:
        positions, tree_mask = linear.copy(), np.full(total, -1, np.int64)  # -1: causal
        for i, s in enumerate(spans):
            if s.parents is None:
                continue
            if len(s.parents) != len(s.token_ids):
                raise ValueError(
                    f"span {i} has {len(s.token_ids)} tokens but {len(s.parents)} parents"
                )
            at = slice(int(cu[i]), int(cu[i + 1]))
            positions[at] = s.start + np.asarray(tree_depths(s.parents))
            tree_mask[at] = tree_mask_of(s.parents)
    wanted = offsets >= (lens - num_logits)[rows]
    return PackedSpans(
        input_ids=np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, total),
        positions=positions,
        slots=slot_mapping(tables, rows, linear, block_size),
        logit_rows=None if wanted.all() else np.flatnonzero(wanted),
        cu_query_lens=cu.astype(np.int32),
        seq_lens=ends.astype(np.int32),
        block_tables=tables,
        tree_mask=tree_mask,
    )


def _pack_small(spans: Sequence[Span], block_size: int) -> PackedSpans:
    """``pack_spans`` of a step of a few tokens, as lists."""
    input_ids, positions, slots, seq_lens, cu, logit_rows = [], [], [], [], [0], []
    trees = any(s.parents is not None for s in spans)
    tree_mask: list[int] = []
    for i, s in enumerate(spans):
        n, start, table = len(s.token_ids), s.start, s.block_table
        end = start + n
        if end > len(table) * block_size:
            raise ValueError(f"span {i} ends at {end}, past its block table")
        input_ids.extend(s.token_ids)
        slots.extend(slot_of(table, pos, block_size) for pos in range(start, end))
        if s.parents is None:
            positions.extend(range(start, end))
            tree_mask.extend([-1] * n * trees)  # every bit: causal
        else:
            if len(s.parents) != n:
                raise ValueError(f"span {i} has {n} tokens but {len(s.parents)} parents")
            positions.extend(start + depth for depth in tree_depths(s.parents))
            tree_mask.extend(tree_mask_of(s.parents))
        seq_lens.append(end)
        cu.append(cu[-1] + n)
        logit_rows.extend(range(cu[-1] - s.num_logits, cu[-1]))
    width = max(len(s.block_table) for s in spans)
    return PackedSpans(
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        logit_rows=None if len(logit_rows) == len(input_ids) else logit_rows,
        cu_query_lens=cu,
        seq_lens=seq_lens,
        block_tables=[[*s.block_table, *[0] * (width - len(s.block_table))] for s in spans],
        tree_mask=tree_mask if trees else None,
    )
