"""Flattens a step into one packed batch, runs the model over it, returns logits to sample.

Every sequence in a step contributes one query span: a prefill chunk, a decode token, or the
last committed token followed by draft tokens. All spans go through the model in a single
forward; attention sees them as ``cu_query_lens`` / ``seq_lens`` over the paged cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.attention import AttentionMetadata
from memory import BlockManager


@dataclass(frozen=True)
class Span:
    """``token_ids`` sit at positions ``start..start+len-1`` of sequence ``seq_id``; the logits
    of the last ``num_logits`` of them are returned."""

    seq_id: int
    token_ids: Sequence[int]
    start: int
    num_logits: int


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_manager: BlockManager,
        attention_backend: str,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.attention_backend = attention_backend
        self.device = device

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: the only KV copy the engine ever makes."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*pairs, strict=True))
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def forward(self, spans: list[Span]) -> torch.Tensor:
        """Run one packed forward; returns float32 logits [sum(num_logits), vocab]."""
        bm = self.block_manager
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_query_lens = [0]
        logit_rows: list[int] = []
        tables = []
        for span in spans:
            n = len(span.token_ids)
            end = span.start + n
            input_ids.extend(span.token_ids)
            positions.extend(range(span.start, end))
            slots.extend(bm.slot_ids(span.seq_id, span.start, end))
            seq_lens.append(end)
            cu_query_lens.append(cu_query_lens[-1] + n)
            logit_rows.extend(range(cu_query_lens[-1] - span.num_logits, cu_query_lens[-1]))
            tables.append(bm.block_table(span.seq_id))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            cu_query_lens=torch.tensor(cu_query_lens, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            backend=self.attention_backend,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
        )
        if len(logit_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.int64, device=dev)]
        return self.model.compute_logits(hidden)
