"""Decode steps replayed as CUDA graphs: one captured forward per padded batch size.

A decode step launches hundreds of small kernels (534 for Llama-3.2-1B); the host cannot issue
them as fast as an H200 runs them (the first GPU check: the GPU busy about 1.6 ms of a 12 ms
step at batch 1). A graph replays the whole forward with one launch. Its inputs live in static
buffers: a step of b decode tokens fills the first b rows and is padded to the next captured
size with rows whose logits nobody reads.

Invariants:
- Only decode steps are graphed: every span one token with one logit row, at most the largest
  captured batch, block tables at most ``max_blocks`` wide. Anything else runs eagerly.
- A padding row writes no KV (slot -1) and attends to one position of the block its table row
  names first. Every table entry, stale ones included, is a block id handed out earlier, so
  reading it is harmless.
- The table buffer keeps its full width at capture and replay: the attention launch (tile
  shape, split count) depends on shapes only, so the captured launch fits every replay.
- The logits returned are a view of the graph's output: valid until the next forward.

Replays compute what the eager step computes, not the same bits: the matmuls run on the padded
row count and the attention launch is planned for the full table width (more KV splits), so
library kernels and summation order may differ. Greedy tokens matched eager ones in the GPU
test (tiny model, float32); long bfloat16 generations can drift apart, as between any two
batch sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.models.attention import AttentionMetadata
from engine.spans import Span, pack_spans

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

# (replay, output): replay() recomputes output in place from the static buffers.
Captured = tuple[Callable[[], object], torch.Tensor]
MAX_GRAPH_BATCH = 256


def uses_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Graphs on CUDA with the compiled Triton kernels (no host sync in a step), unless
    enforce_eager. Not under TRITON_INTERPRET=1: the interpreter copies tensors to the host."""
    backend = config.attention_backend in ("auto", "triton")
    if device.type != "cuda" or not backend or config.enforce_eager:
        return False
    # only on CUDA: a CPU process never imports triton
    from kernels.triton_attention import _attention_kernel
    from kernels.triton_setup import interpreted

    return not interpreted(_attention_kernel)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 below min(max_num_seqs, MAX_GRAPH_BATCH), then it."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [b for b in (1, 2, 4, 8, *range(16, top, 16)) if b < top] + [top]


class CudaGraphCapture:
    """Captures a forward into a torch.cuda.CUDAGraph; every capture shares one memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Captured:
        forward()  # warm-up outside the capture: lazy initialisation, Triton compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        return graph.replay, out


def rerun_capture(forward: Callable[[], torch.Tensor]) -> Captured:
    """CudaGraphCapture's stand-in off CUDA (the tests): replay reruns the forward eagerly on the
    same static buffers and copies into the same output, so everything but the graph is tested."""
    out = forward()
    return (lambda: out.copy_(forward())), out


class DecodeGraphs:
    """The static input buffers and one captured forward per batch size of ``batch_sizes``."""

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: Sequence[int],
        max_blocks: int,
        capture: Callable[[Callable[[], torch.Tensor]], Captured],
    ) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.max_blocks = max_blocks
        n = self.batch_sizes[-1]
        device = runner.device
        # ids, positions, slots (-1: write nothing); cu_query_lens, then seq_lens (one token
        # each) from a 16-byte boundary like the eager runner's (Triton specialises on alignment)
        self.int64 = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.int64[2] = -1
        self.lens_at = -(-(n + 1) // 4) * 4
        cu = torch.arange(self.lens_at).clamp(max=n)
        self.int32 = torch.cat([cu, torch.ones(n)]).to(device, torch.int32)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.replays = 0  # graphed steps so far
        self.graphs: dict[int, Captured] = {}
        with torch.inference_mode():
            for b in reversed(self.batch_sizes):  # the largest first: the pool then fits all
                self.graphs[b] = capture(lambda b=b: self._forward(b))

    def _forward(self, b: int) -> torch.Tensor:
        """The model over the first ``b`` rows of the static buffers -> float32 logits [b, V]."""
        ids, positions, slots = self.int64[:, :b]
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_query_lens=self.int32[: b + 1],
            seq_lens=self.int32[self.lens_at : self.lens_at + b],
            block_tables=self.block_tables[:b],
            backend=self.runner.attention_backend,
        )
        model = self.runner.model
        return model.compute_logits(model(ids, positions, self.runner.kv_caches, meta))

    def fits(self, spans: Sequence[Span]) -> bool:
        size = self.runner.block_size
        return 0 < len(spans) <= self.batch_sizes[-1] and all(
            len(s.token_ids) == 1
            and s.num_logits == 1
            and len(s.block_table) <= self.max_blocks
            and s.start < len(s.block_table) * size
            for s in spans
        )

    def run(self, spans: Sequence[Span]) -> torch.Tensor:
        """Logits [len(spans), V] of a decode step (``fits``), replayed at the next captured
        size; the padding rows keep the buffers' padding values (slot -1, one-token spans)."""
        b, n = len(spans), self.batch_sizes[-1]
        padded = next(g for g in self.batch_sizes if g >= b)
        packed = pack_spans(spans, self.runner.block_size)
        int64 = torch.zeros(3, n, dtype=torch.int64)
        int64[2] = -1  # padding rows write no K/V
        for row, values in enumerate((packed.input_ids, packed.positions, packed.slots)):
            int64[row, :b] = torch.as_tensor(values)
        # cu_query_lens never change (one token per row): only the seq_lens after them do
        seq_lens = torch.ones(n, dtype=torch.int32)
        seq_lens[:b] = torch.as_tensor(packed.seq_lens)
        table = torch.as_tensor(packed.block_tables, dtype=torch.int32)
        self._copy(self.int64, int64)
        self._copy(self.int32[self.lens_at :], seq_lens)
        self._copy(self.block_tables[:b, : table.shape[1]], table)
        replay, out = self.graphs[padded]
        replay()
        self.replays += 1
        return out[:b]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host to device; on CUDA from pinned memory, asynchronously (the pinned-block cache
        reuses a block only once its copy is done)."""
        if dst.device.type == "cuda":
            src = src.pin_memory()
        dst.copy_(src, non_blocking=dst.device.type == "cuda")
