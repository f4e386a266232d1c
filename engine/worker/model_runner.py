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
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from pagedspec.engine.models.attention import AttentionMetadata
from pagedspec.engine.worker.spans import Index, PackedSpans, Span, pack_spans, with_pending
from pagedspec.memory import slot_of

if TYPE_CHECKING:
    from pagedspec.engine.worker.cpu_threads import ThreadGovernor


@dataclass(frozen=True)
class ForwardOutput:
    """What a forward returns: float32 logits [sum(num_logits), vocab], and the hidden states
    where they were asked for (``return_hidden``), else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class Replay(Protocol):
    """Steps replayed from captured graphs (``pagedspec.engine.worker.cuda_graphs.StepGraphs``):
    the runner asks whether a step fits, then replays it (logits, or (logits, hidden))."""

    def fits(
        self, spans: Sequence[Span], return_hidden: bool, hidden_layers: tuple, features: bool
    ) -> bool: ...

    def run(
        self, spans: Sequence[Span], features: torch.Tensor | None, pending: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


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
        # Decode and verification steps replayed as CUDA graphs
        # (pagedspec.engine.worker.cuda_graphs); None: always eager.
        self.graphs: Replay | None = None
        # Sets the CPU kernels' thread count from the load, checked per forward; None: fixed.
        self.threads: ThreadGovernor | None = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks (the other KV copy the engine makes is ``move_kv``)."""
        self._copy_rows(pairs, lambda cache: cache)

    def move_kv(self, block_table: Sequence[int], moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of each (src, dst) position of the sequence ``block_table`` addresses, in
        every layer: an accepted draft-tree leaf's K/V, written at its slot in the span, to its
        position's (pagedspec.engine.spec_decode.tree)."""
        size = self.block_size
        pairs = [
            (slot_of(block_table, src, size), slot_of(block_table, dst, size)) for src, dst in moves
        ]
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

    def _index_tensors(self, arrays: list[Index], int32: list[bool]) -> list[torch.Tensor]:
        """The step's index arrays (or lists) as tensors on the device, int32 where ``int32``
        says so, else int64.

        On the CPU a numpy array is shared (no copy). Elsewhere one host-to-device copy for all
        (on CUDA from pinned memory, asynchronously: PyTorch's pinned-block cache reuses a block
        only once its copy is done), as int64 then viewed back to each dtype. Each starts
        16-byte aligned (padded to 4 entries) like a tensor of its own: Triton specialises
        kernels on pointer alignment.
        """
        dtypes = [torch.int32 if narrow else torch.int64 for narrow in int32]
        if self.device.type == "cpu":
            return [torch.as_tensor(a, dtype=d) for a, d in zip(arrays, dtypes, strict=True)]
        arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
        sizes = [a.size + -a.size % 4 for a in arrays]
        host = torch.zeros(sum(sizes), dtype=torch.int64)
        at = 0
        for a, size in zip(arrays, sizes, strict=True):
            host[at : at + a.size] = torch.from_numpy(a.reshape(-1))
            at += size
        if self.device.type == "cuda":
            host = host.pin_memory()
        staged = host.to(self.device, non_blocking=True)
        return [
            view[: a.size].to(d).view(a.shape)
            for a, view, d in zip(arrays, staged.split(sizes), dtypes, strict=True)
        ]

    @torch.inference_mode()
    def forward(
        self,
        spans: list[Span],
        return_hidden: bool = False,
        features: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        pending: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Run one packed forward: float32 logits [sum(num_logits), vocab], and with
        ``return_hidden`` the final hidden states of every token too, after those of the layers
        in ``hidden_layers`` (``LlamaModel.forward``'s ``capture``). ``features`` (one row per
        token) go to a model that reads them (a draft head), which computes only the rows that
        take logits: its hidden states are those rows'. ``pending``: token ids on the device
        that the host has not read (async scheduling); a span token ``-1 - i`` is
        ``pending[i]``. Steps that ``graphs`` fit replay a captured graph: their outputs are
        valid until the next forward."""
        args = (spans, return_hidden, features, hidden_layers, pending)
        if self.threads is None:
            return self._forward(*args)
        self.threads.tick()
        try:
            return self._forward(*args)
        finally:
            self.threads.done()

    def _forward(
        self,
        spans: list[Span],
        return_hidden: bool,
        features: torch.Tensor | None,
        hidden_layers: tuple[int, ...],
        pending: torch.Tensor | None,
    ) -> ForwardOutput:
        graphs, fed = self.graphs, features is not None
        if graphs is not None and graphs.fits(spans, return_hidden, hidden_layers, fed):
            out = graphs.run(spans, features, pending)
            return ForwardOutput(*out) if isinstance(out, tuple) else ForwardOutput(out)
        packed = pack_spans(spans, self.block_size)
        ids, pos, meta, rows_index = self._inputs(packed)
        if pending is not None:
            ids = with_pending(ids, pending)
        if features is not None:  # a draft head computes its logit rows only
            if any(span.num_logits > 1 for span in spans):
                raise ValueError("a draft head's spans take at most one logit row each")
            row_index = (
                rows_index if rows_index is not None else torch.arange(len(ids), device=ids.device)
            )
            hidden = self.model(ids, pos, self.kv_caches, meta, features, row_index)
            rows = hidden
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, hidden_layers)
            final = hidden[:, -self.model.config.hidden_size :] if hidden_layers else hidden
            rows = final if rows_index is None else final[rows_index]
        logits = self.model.compute_logits(rows)
        return ForwardOutput(logits, hidden if return_hidden else None)

    def _inputs(
        self, packed: PackedSpans
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """(input ids, positions, attention metadata, logit-row index or None: every row)."""
        arrays = [
            packed.input_ids, packed.positions, packed.slots, packed.cu_query_lens,
            packed.seq_lens, packed.block_tables,
        ]  # fmt: skip
        optional = [a for a in (packed.logit_rows, packed.tree_mask) if a is not None]
        int32 = [False] * 3 + [True] * 3 + [False] * len(optional)
        ids, pos, slots, cu, lens, tables, *more = self._index_tensors(arrays + optional, int32)
        rows_index = more.pop(0) if packed.logit_rows is not None else None
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_query_lens=cu,
            seq_lens=lens,
            block_tables=tables,
            backend=self.attention_backend,
            tree_mask=more[0] if more else None,
        )
        return ids, pos, meta, rows_index
