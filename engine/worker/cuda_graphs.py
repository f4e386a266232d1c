"""Steps replayed as CUDA graphs: one captured forward per span length and padded batch size.

A decode step launches hundreds of small kernels (534 for Llama-3.2-1B); the host cannot issue
them as fast as an H200 runs them (the first GPU check: the GPU busy about 1.6 ms of a 12 ms
step at batch 1). A graph replays the whole forward with one launch. Its inputs live in static
buffers: a step of b spans fills the first b of them and is padded to the next captured size.

Two families of graphs: decode steps (one token per span) and, with speculation, verification
steps, each span the last token and up to k drafts (and a draft tree's leaves), padded to the
longest span the configuration makes. A draft tree rides on the tree-mask buffer (-1: causal).
With an EAGLE head the target's graphs also return its hidden states, as the eager forward does,
and the head's draft steps (one token a span, fed features) have graphs of their own.

Invariants:
- Only steps whose every span wants a logit row per token are graphed (decodes and
  verifications), at most the family's largest batch, block tables at most ``max_blocks`` wide,
  every token inside its table. Anything else (prefill chunks) runs eagerly.
- A padding row (a padding span's, or past a span's last token) writes no KV (slot -1); its
  logits are dropped. A real row never sees it: it sits after the span's tokens, and attention
  is causal (a tree's mask names ancestors only). A padding span attends to positions of the
  block its table row names first; every table entry, stale ones included, is a block id handed
  out earlier, so reading it is harmless.
- The table buffer keeps its full width at capture and replay: the attention launch (tile
  shape, split count) depends on shapes only, so the captured launch fits every replay. A
  padded span reads up to (span length - 1) slots past its tokens: its family's tables have
  that many more columns, never written (block 0).
- The outputs are the graph's buffers (decode: a view of them): valid until the next forward.

Replays compute what the eager step computes, not the same bits: the matmuls run on the padded
row count and the attention launch is planned for the full table width (more KV splits), so
library kernels and summation order may differ. Greedy tokens matched eager ones in the GPU
test (tiny model, float32); long bfloat16 generations can drift apart, as between any two
batch sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedspec.engine.models.attention import AttentionMetadata
from pagedspec.engine.worker.spans import Span, pack_spans, with_pending

if TYPE_CHECKING:
    from pagedspec.engine.worker.model_runner import ModelRunner

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # logits[, hidden states]
# (replay, output): replay() recomputes output in place from the static buffers.
Captured = tuple[Callable[[], object], Output]


class _Family:
    """The static buffers of the graphs whose spans are padded to ``span_len`` tokens: per row
    the ids, positions, slots (-1: write nothing) and, for draft trees, the tree mask (-1:
    causal); cu_query_lens (multiples of span_len), then seq_lens from a 16-byte boundary like
    the eager runner's (Triton specialises on alignment); the block tables."""

    def __init__(
        self,
        span_len: int,
        batch_sizes: Sequence[int],
        max_blocks: int,
        trees: bool,
        device: torch.device,
        features: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.span_len = span_len
        self.batch_sizes = sorted(batch_sizes)
        self.trees = trees
        n = self.batch_sizes[-1]
        if features is not None:  # a draft head's: its input features, and every row's index
            width, dtype = features
            self.features = torch.zeros(n * span_len, width, dtype=dtype, device=device)
            self.rows = torch.arange(n * span_len, device=device)
        self.int64 = torch.zeros(3 + trees, n * span_len, dtype=torch.int64, device=device)
        self.int64[2:] = -1
        self.lens_at = -(-(n + 1) // 4) * 4
        cu = torch.arange(self.lens_at).clamp(max=n) * span_len
        self.int32 = torch.cat([cu, torch.full((n,), span_len)]).to(device, torch.int32)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, Captured] = {}
        self.replays = 0  # steps it replayed so far


class StepGraphs:
    """The graph families (span length -> batch sizes) of one runner, and their dispatch.

    ``hidden_layers`` None: the graphs return logits, as a plain forward; else (an EAGLE target)
    logits and hidden states, as ``forward(return_hidden=True, hidden_layers=...)``. With
    ``features`` (width, dtype), a draft head's: its draft steps, one token per span, take
    features and return logits and hidden states, as ``forward(features=, return_hidden=True)``.
    """

    def __init__(
        self,
        runner: ModelRunner,
        families: dict[int, Sequence[int]],
        max_blocks: int,
        capture: Callable[[Callable[[], Output]], Captured],
        trees: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        features: tuple[int, torch.dtype] | None = None,
    ) -> None:
        self.runner = runner
        self.max_blocks = max_blocks
        self.hidden_layers = hidden_layers
        self.takes_features = features is not None
        # A padded span's seq_len counts its padding rows: its table reads up to (q - 1) slots
        # past its tokens, so a family's tables have that many more columns, all block 0.
        size = runner.block_size
        self.families = {
            q: _Family(
                q, sizes, max_blocks - (-(q - 1) // size), trees and q > 1, runner.device, features
            )  # fmt: skip
            for q, sizes in sorted(families.items())
        }
        with torch.inference_mode():
            for family in self.families.values():
                for b in reversed(family.batch_sizes):  # the largest first: the pool fits all
                    family.graphs[b] = capture(lambda f=family, b=b: self._forward(f, b))

    def _forward(self, family: _Family, b: int) -> Output:
        """The model over the first ``b`` spans of ``family``'s buffers -> float32 logits for
        every row (and the hidden states)."""
        rows = b * family.span_len
        ids, positions, slots = family.int64[:3, :rows]
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_query_lens=family.int32[: b + 1],
            seq_lens=family.int32[family.lens_at : family.lens_at + b],
            block_tables=family.block_tables[:b],
            backend=self.runner.attention_backend,
            tree_mask=family.int64[3, :rows] if family.trees else None,
        )
        model = self.runner.model
        if self.takes_features:  # a draft head: every row a logit row
            kv_caches = self.runner.kv_caches
            hidden = model(
                ids, positions, kv_caches, meta, family.features[:rows], family.rows[:rows]
            )
            return model.compute_logits(hidden), hidden
        if self.hidden_layers is None:
            return model.compute_logits(model(ids, positions, self.runner.kv_caches, meta))
        hidden = model(ids, positions, self.runner.kv_caches, meta, self.hidden_layers)
        final = hidden[:, -model.config.hidden_size :] if self.hidden_layers else hidden
        return model.compute_logits(final), hidden

    def fits(
        self,
        spans: Sequence[Span],
        return_hidden: bool = False,
        hidden_layers: tuple = (),
        features: bool = False,
    ) -> bool:
        """Whether a forward of ``spans`` with these options replays a graph."""
        if features != self.takes_features:
            return False
        wanted = tuple(hidden_layers) if return_hidden else None
        if features and (not return_hidden or hidden_layers):
            return False
        if not features and (wanted != self.hidden_layers or hidden_layers and not return_hidden):
            return False
        family = self._family(spans)
        size = self.runner.block_size
        return (
            family is not None
            and 0 < len(spans) <= family.batch_sizes[-1]
            and all(
                s.num_logits == len(s.token_ids)
                and len(s.block_table) <= self.max_blocks
                and s.start + len(s.token_ids) <= len(s.block_table) * size
                and (s.parents is None or family.trees)
                for s in spans
            )
        )

    def _family(self, spans: Sequence[Span]) -> _Family | None:
        """The family of the shortest span length that holds every span."""
        longest = max((len(s.token_ids) for s in spans), default=0)
        return next((f for q, f in self.families.items() if q >= longest > 0), None)

    def run(
        self,
        spans: Sequence[Span],
        features: torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
    ) -> Output:
        """A ``fits`` step's outputs, replayed at the next captured size: the rows of the
        spans' tokens, in order (decode: views of the graph's outputs). ``features`` and
        ``pending`` as ``ModelRunner.forward`` takes them."""
        family = self._family(spans)
        q, b, n = family.span_len, len(spans), family.batch_sizes[-1]
        padded = next(g for g in family.batch_sizes if g >= b)
        packed = pack_spans(spans, self.runner.block_size)
        lens = np.diff(np.asarray(packed.cu_query_lens))
        rows = np.repeat(np.arange(b), lens)
        dest = rows * q + np.arange(len(rows)) - np.asarray(packed.cu_query_lens)[rows]
        int64 = torch.zeros(family.int64.shape, dtype=torch.int64)
        int64[2:] = -1  # padding rows write no K/V (and are causal)
        tree_mask = packed.tree_mask if packed.tree_mask is not None else np.full(len(rows), -1)
        values = (packed.input_ids, packed.positions, packed.slots, tree_mask)[: len(int64)]
        for row, value in enumerate(values):
            int64[row, dest] = torch.as_tensor(np.asarray(value), dtype=torch.int64)
        # a span's seq_len counts its padding rows: start + q (a padding span: q)
        seq_lens = torch.full((n,), q, dtype=torch.int32)
        seq_lens[:b] = torch.as_tensor(np.asarray(packed.seq_lens) - lens + q)
        table = torch.as_tensor(np.asarray(packed.block_tables), dtype=torch.int32)
        self._copy(family.int64, int64)
        if pending is not None:  # placeholders resolved on the device
            family.int64[0] = with_pending(family.int64[0], pending)
        self._copy(family.int32[family.lens_at :], seq_lens)
        self._copy(family.block_tables[:b, : table.shape[1]], table)
        if features is not None:  # already on the device
            family.features[torch.as_tensor(dest, device=features.device)] = features
        replay, out = family.graphs[padded]
        replay()
        family.replays += 1
        if q == 1:  # the rows are the first b
            return tuple(o[:b] for o in out) if isinstance(out, tuple) else out[:b]
        index = torch.as_tensor(dest, device=self.runner.device)
        return tuple(o[index] for o in out) if isinstance(out, tuple) else out[index]

    @property
    def replays(self) -> int:
        """Graphed steps so far."""
        return sum(f.replays for f in self.families.values())

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host to device; on CUDA from pinned memory, asynchronously (the pinned-block cache
        reuses a block only once its copy is done)."""
        if dst.device.type == "cuda":
            src = src.pin_memory()
        dst.copy_(src, non_blocking=dst.device.type == "cuda")
