"""Flattens a step into one packed batch, runs the model over it, returns logits to sample.

Every sequence in a step contributes one query span: a prefill chunk, a decode token, or the
last committed token followed by draft tokens. All spans go through the model in a single
forward; attention sees them as ``cu_query_lens`` / ``seq_lens`` over the paged cache. The
runner addresses the cache only through the block tables its spans carry (the scheduler's
snapshot): it never asks the block manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.attention import AttentionMetadata


@dataclass(frozen=True)
class Span:
    """``token_ids`` sit at positions ``start..start+len-1`` of a sequence whose KV blocks are
    ``block_table``; the logits of the last ``num_logits`` of them are returned."""

    token_ids: Sequence[int]
    start: int
    num_logits: int
    block_table: Sequence[int]


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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: the only KV copy the engine ever makes."""
        if not pairs:
            return
        src, dst = self._to_device([x for pair in zip(*pairs, strict=True) for x in pair]).chunk(2)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """``values`` as one int64 tensor on the device. On CUDA through pinned memory, copied
        asynchronously: PyTorch's pinned-block cache reuses a block only once its copy is done."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(
        self,
        spans: list[Span],
        return_hidden: bool = False,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one packed forward; returns float32 logits [sum(num_logits), vocab], and with
        ``return_hidden`` the final hidden states of every token too. ``features`` (one row per
        token) go to a model that reads them (a draft head)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_query_lens = [0]
        logit_rows: list[int] = []
        size = self.block_size
        for i, span in enumerate(spans):
            n = len(span.token_ids)
            start, end, table = span.start, span.start + n, span.block_table
            if end > len(table) * size:
                raise ValueError(f"span {i} ends at {end}, past its block table")
            input_ids.extend(span.token_ids)
            positions.extend(range(start, end))
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
        tables = [x for s in spans for x in (*s.block_table, *[0] * (width - len(s.block_table)))]
        # Every index tensor of the step in one host-to-device copy, the int32 ones last (made by
        # one conversion). Each starts 16-byte aligned (padded to 4 entries) like a tensor of its
        # own: Triton specialises kernels on pointer alignment.
        parts = (input_ids, positions, slots, logit_rows, cu_query_lens, seq_lens, tables)
        padded = [len(part) + -len(part) % 4 for part in parts]
        staged = self._to_device([x for p in parts for x in (*p, *[0] * (-len(p) % 4))])
        wide = sum(padded[:4])
        views = staged[:wide].split(padded[:4]) + staged[wide:].to(torch.int32).split(padded[4:])
        ids, pos, slot_mapping, rows_index, cu, lens, block_tables = (
            view[: len(part)] for view, part in zip(views, parts, strict=True)
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_query_lens=cu,
            seq_lens=lens,
            block_tables=block_tables.view(len(spans), width),
            backend=self.attention_backend,
        )
        extra = {} if features is None else {"features": features}
        hidden = self.model(ids, pos, self.kv_caches, meta, **extra)
        rows = hidden if len(logit_rows) == hidden.shape[0] else hidden[rows_index]
        logits = self.model.compute_logits(rows)
        return (logits, hidden) if return_hidden else logits
