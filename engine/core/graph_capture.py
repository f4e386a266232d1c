"""Which steps an engine replays as CUDA graphs (``pagedspec.engine.worker.cuda_graphs``), and their
capture: decode steps up to ``max_num_seqs`` and, with speculation, verification steps up to the
batch where speculation switches off, at padded batch sizes; an EAGLE head's draft steps too. A
runner whose capture fails serves eagerly, with a warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedspec.engine.worker.cuda_graphs import Captured, Output, StepGraphs

if TYPE_CHECKING:
    from pagedspec.engine.config import EngineConfig, SpeculativeConfig
    from pagedspec.engine.spec_decode.eagle import EagleProposer
    from pagedspec.engine.worker.model_runner import ModelRunner

MAX_GRAPH_BATCH = 256


def uses_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Graphs on CUDA with the compiled Triton kernels (no host sync in a step), unless
    enforce_eager. Not under TRITON_INTERPRET=1: the interpreter copies tensors to the host."""
    backend = config.attention_backend in ("auto", "triton")
    if device.type != "cuda" or not backend or config.enforce_eager:
        return False
    # only on CUDA: a CPU process never imports triton
    from pagedspec.kernels.triton_attention import _attention_kernel
    from pagedspec.kernels.triton_setup import interpreted

    return not interpreted(_attention_kernel)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 below min(max_num_seqs, MAX_GRAPH_BATCH), then it."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [b for b in (1, 2, 4, 8, *range(16, top, 16)) if b < top] + [top]


def graph_families(max_num_seqs: int, spec: SpeculativeConfig | None) -> dict[int, list[int]]:
    """Span length -> captured batch sizes: decodes up to ``max_num_seqs`` and, with
    speculation, verifications (the last token, k drafts and the tree's leaves) up to the
    batch from which speculation is off."""
    families = {1: graph_batch_sizes(max_num_seqs)}
    if spec is not None and spec.disable_batch_size > 1:
        span = 1 + spec.num_speculative_tokens + spec.draft_leaves  # a chain and its leaves
        families[span] = graph_batch_sizes(min(max_num_seqs, spec.disable_batch_size - 1))
    return families


class CudaGraphCapture:
    """Captures a forward into a torch.cuda.CUDAGraph; every capture shares one memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, forward: Callable[[], Output]) -> Captured:
        forward()  # warm-up outside the capture: lazy initialisation, Triton compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        self.pool = graph.pool()
        return graph.replay, out


def rerun_capture(forward: Callable[[], Output]) -> Captured:
    """CudaGraphCapture's stand-in off CUDA (the tests): replay reruns the forward eagerly on the
    same static buffers and copies into the same outputs, so everything but the graph is tested."""
    out = forward()
    outs = out if isinstance(out, tuple) else (out,)

    def replay() -> None:
        again = forward()
        for old, new in zip(outs, again if isinstance(again, tuple) else (again,), strict=True):
            old.copy_(new)

    return replay, out


def capture_graphs(
    config: EngineConfig,
    max_model_len: int,
    target: ModelRunner,
    eagle: EagleProposer | None,
    capture: Callable[[Callable[[], Output]], Captured],
) -> None:
    """The graphs of an engine's runners: the target's decode and verification steps (with an
    EAGLE head, returning hidden states too) and the head's draft steps. A runner whose capture
    fails runs eagerly, with a warning: it still serves, slower."""
    spec = config.speculative_config
    families = graph_families(config.max_num_seqs, spec)
    max_blocks = -(-max_model_len // config.block_size)
    trees = spec is not None and spec.draft_leaves > 0
    hidden_layers = None if eagle is None else eagle.hidden_layers
    target.graphs = _captured(
        "the target's",
        lambda: StepGraphs(target, families, max_blocks, capture, trees, hidden_layers),
    )
    if eagle is not None:  # its draft steps: one token a span, up to where speculation stops
        head = eagle.head
        features = (head.config.hidden_size, head.fc.weight.dtype)
        drafts = {1: families[max(families)]}
        eagle.runner.graphs = _captured(
            "the EAGLE head's",
            lambda: StepGraphs(eagle.runner, drafts, max_blocks, capture, features=features),
        )


def _captured(whose: str, make: Callable[[], StepGraphs]) -> StepGraphs | None:
    try:
        return make()
    except RuntimeError as error:
        warnings.warn(
            f"CUDA graphs off for {whose} forwards: capture failed: {error}", stacklevel=3
        )
        return None
