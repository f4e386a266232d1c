"""Query spans, and one step's spans packed into the index arrays a forward reads.

Every sequence in a step contributes one span: a prefill chunk, a decode token, or the last
committed token followed by draft tokens. Packing is vectorised over the batch (numpy): the
only per-span Python is reading each span's fields once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kernels.tree_mask import tree_mask_of
from memory import slot_mapping


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


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth in a tree given as Span.parents (token 0: depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return depths


class PackedSpans(NamedTuple):
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    logit_rows: np.ndarray | None  # int64 [R]: the rows whose logits are wanted; None: all
    cu_query_lens: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, max table length], zero-padded
    tree_mask: np.ndarray | None  # int64 [T] (kernels' tree_mask); None: every span causal


def pack_spans(spans: Sequence[Span], block_size: int) -> PackedSpans:
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
