"""Flattens a step into one packed batch, runs the model over it, returns logits to sample.

Every sequence in a step contributes one query span: a prefill chunk, a decode token, or the
last committed token followed by draft tokens. All spans go through the model in a single
forward; attention sees them as ``cu_query_lens`` / ``seq_lens`` over the paged cache. The
runner addresses the cache only through the block tables its spans carry (the scheduler's
snapshot): it never asks the block manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.attention import AttentionMetadata
from kernels.reference import tree_mask_of

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs


@dataclass(frozen=True)
class Span:
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


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attention_backend: str,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0][0].shape[1]
        self.attention_backend = attention_backend
        self.device = device
        # Decode steps replayed as CUDA graphs (engine.cuda_graphs); None: always eager.
        self.graphs: DecodeGraphs | None = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks (the other KV copy the engine makes is ``move_kv``)."""
        self._copy_rows(pairs, lambda cache: cache)

    def move_kv(self, block_table: Sequence[int], moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of each (src, dst) position of the sequence ``block_table`` addresses, in
        every layer: an accepted draft-tree leaf's K/V, written at its slot in the span, to its
        position's (engine.spec_decode.tree)."""
        size = self.block_size

        def slot(pos: int) -> int:
            return block_table[pos // size] * size + pos % size

        pairs = [(slot(src), slot(dst)) for src, dst in moves]
        self._copy_rows(pairs, lambda cache: cache.view(-1, *cache.shape[2:]))

    def _copy_rows(
        self, pairs: list[tuple[int, int]], rows: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """cache[dst] = cache[src] over ``rows(cache)`` (blocks, or slots) of every K and V."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs, strict=True))
        for cache in (c for layer in self.kv_caches for c in layer):
            view = rows(cache)
            view[dst] = view[src]

    def _index_tensors(
        self, int64: list[list[int]], int32: list[list[int]], tables: list[list[int]]
    ) -> list[torch.Tensor]:
        """The step's index lists as tensors on the device: int64 ones, int32 ones, then the
        block tables (rows of equal length) as one int32 [rows, width] tensor.

        On the CPU one tensor each. Elsewhere one host-to-device copy for all (on CUDA from
        pinned memory, asynchronously: PyTorch's pinned-block cache reuses a block only once its
        copy is done), the int32 ones made by one conversion. Each starts 16-byte aligned (padded
        to 4 entries) like a tensor of its own: Triton specialises kernels on pointer alignment.
        """
        if self.device.type == "cpu":
            wide = [torch.tensor(p, dtype=torch.int64) for p in int64]
            return wide + [torch.tensor(p, dtype=torch.int32) for p in [*int32, tables]]
        parts = [*int64, *int32, [x for row in tables for x in row]]
        host = torch.tensor([x for p in parts for x in (*p, *[0] * (-len(p) % 4))])
        if self.device.type == "cuda":
            host = host.pin_memory()
        staged = host.to(self.device, non_blocking=True)
        sizes = [len(p) + -len(p) % 4 for p in parts]
        wide = sum(sizes[: len(int64)])
        views = staged[:wide].split(sizes[: len(int64)])
        views += staged[wide:].to(torch.int32).split(sizes[len(int64) :])
        out = [view[: len(p)] for view, p in zip(views, parts, strict=True)]
        return out[:-1] + [out[-1].view(len(tables), -1)]

    @torch.inference_mode()
    def forward(
        self,
        spans: list[Span],
        return_hidden: bool = False,
        features: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one packed forward; returns float32 logits [sum(num_logits), vocab], and with
        ``return_hidden`` the final hidden states of every token too, after those of the layers
        in ``hidden_layers`` (``LlamaModel.forward``'s ``capture``). ``features`` (one row per
        token) go to a model that reads them (a draft head), which computes only the rows that
        take logits: its hidden states are those rows'. Decode steps that ``graphs`` fit replay
        a captured graph: their logits are valid until the next forward."""
        plain = features is None and not return_hidden and not hidden_layers
        if plain and self.graphs is not None and self.graphs.fits(spans):
            return self.graphs.run(spans)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_query_lens = [0]
        logit_rows: list[int] = []
        tree_mask: list[int] = []
        trees = any(span.parents is not None for span in spans)
        size = self.block_size
        for i, span in enumerate(spans):
            n = len(span.token_ids)
            start, end, table = span.start, span.start + n, span.block_table
            if end > len(table) * size:
                raise ValueError(f"span {i} ends at {end}, past its block table")
            input_ids.extend(span.token_ids)
            if span.parents is None:
                positions.extend(range(start, end))
                tree_mask.extend([-1] * n * trees)  # every bit: causal
            else:
                if len(span.parents) != n:
                    raise ValueError(f"span {i} has {n} tokens but {len(span.parents)} parents")
                positions.extend(start + d for d in tree_depths(span.parents))
                tree_mask.extend(tree_mask_of(span.parents))
            pos = start
            while pos < end:  # slot = block * block_size + offset, one run per block touched
                index, offset = divmod(pos, size)
                run = min(size - offset, end - pos)
                base = table[index] * size + offset
                slots.extend(range(base, base + run))
                pos += run
            seq_lens.append(end)
            cu_query_lens.append(cu_query_lens[-1] + n)
            logit_rows.extend(range(cu_query_lens[-1] - span.num_logits, cu_query_lens[-1]))
        width = max(len(s.block_table) for s in spans)
        tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in spans]
        # The logit-row index only where some token's logits are not wanted.
        every_row = len(logit_rows) == len(input_ids)
        int64 = [input_ids, positions, slots] + [logit_rows] * (not every_row)
        ids, pos, slot_mapping, *rows_index, cu, lens, block_tables = self._index_tensors(
            int64, [cu_query_lens, seq_lens], tables
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_query_lens=cu,
            seq_lens=lens,
            block_tables=block_tables,
            backend=self.attention_backend,
            tree_mask=torch.tensor(tree_mask, device=ids.device) if trees else None,
        )
        if features is not None:  # a draft head computes its logit rows only
            if any(span.num_logits > 1 for span in spans):
                raise ValueError("a draft head's spans take at most one logit row each")
            row_index = (
                rows_index[0] if rows_index else torch.arange(len(input_ids), device=ids.device)
            )
            hidden = self.model(ids, pos, self.kv_caches, meta, features, row_index)
            rows = hidden
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, hidden_layers)
            final = hidden[:, -self.model.config.hidden_size :] if hidden_layers else hidden
            rows = final if every_row else final[rows_index[0]]
        logits = self.model.compute_logits(rows)
        return (logits, hidden) if return_hidden else logits
